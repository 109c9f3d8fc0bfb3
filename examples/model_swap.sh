#!/usr/bin/env bash
# Change an index's embedding model safely: build with one model, reindex to another (resumable,
# gated, swapped atomically), search through the new one, roll back, read the ledger.
# Runs in this process with the bundled models (no server needed); a server serving both models
# (`embedserve serve --model all-MiniLM-L6-v2 --model multilingual-e5-small`) switches at the swap.
set -euo pipefail
EMBEDSERVE=${EMBEDSERVE:-embedserve}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
export EMBEDSERVE_INDEX_DIR="$DIR/indexes"

cat > "$DIR/docs.jsonl" <<'JSONL'
{"id": "danube", "text": "The Danube flows through Vienna, Bratislava, Budapest and Belgrade."}
{"id": "seine", "text": "The Seine flows through Paris before it reaches the English Channel."}
{"id": "yangtze", "text": "长江是中国最长的河流，流经上海。"}
{"id": "rhine", "text": "Der Rhein fließt durch Basel, Straßburg, Köln und Rotterdam."}
JSONL

$EMBEDSERVE index create rivers --model all-MiniLM-L6-v2 > /dev/null
$EMBEDSERVE index add rivers "$DIR/docs.jsonl" > /dev/null
echo "== all-MiniLM-L6-v2"; $EMBEDSERVE index search rivers "Which river flows through Shanghai?" --top-k 2
$EMBEDSERVE reindex --index rivers --to-model multilingual-e5-small --sample 4 2> /dev/null | grep -E '"(version|to_model|swapped)"'
echo "== multilingual-e5-small"; $EMBEDSERVE index search rivers "Which river flows through Shanghai?" --top-k 2
$EMBEDSERVE reindex --index rivers --rollback 2> /dev/null | grep -E '"(kind|version)"'
echo "== history"; $EMBEDSERVE index history rivers | grep -E '"(kind|version|to_model)"'

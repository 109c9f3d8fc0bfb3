"""An ingestion job: upsert a JSONL file ({id, text, metadata} per line) into an index, with a
progress bar, a summary, and resume from where a previous run stopped.

    python examples/ingest_jsonl.py corpus.jsonl --index docs            # first run
    python examples/ingest_jsonl.py corpus.jsonl --index docs --start 5000   # resume after a crash
    python examples/ingest_jsonl.py                                       # writes a demo file first
"""

import argparse
import json
import tempfile
from pathlib import Path

from embedserve.client import Client


def demo_file() -> Path:
    path = Path(tempfile.gettempdir()) / "embedserve-demo-corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(500):
            f.write(json.dumps({"id": f"demo-{i}", "text": f"Demo document {i} about topic {i % 12}.",
                                "metadata": {"topic": i % 12}}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", type=Path)
    ap.add_argument("--index", default="ingest-demo")
    ap.add_argument("--start", type=int, default=0, help="document offset to resume from")
    args = ap.parse_args()
    path = args.path or demo_file()
    with Client() as client:
        try:
            summary = client.ingest(args.index, path, start=args.start)
        except KeyboardInterrupt as exc:
            print(f"\ninterrupted; resume with --start {exc.next_offset}")
            raise SystemExit(130)
    print(json.dumps(summary.to_dict(), indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()

"""Embed, create an index, upsert, search — against a running `make serve` (or $EMBEDSERVE_URL).

    python examples/quickstart.py
"""

from embedserve.client import Client

DOCS = [
    {"id": "paris", "text": "Paris is the capital and largest city of France.", "metadata": {"lang": "en"}},
    {"id": "beijing", "text": "北京是中华人民共和国的首都。", "metadata": {"lang": "zh"}},
    {"id": "faiss", "text": "FAISS is a library for efficient similarity search of dense vectors.", "metadata": {"lang": "en"}},
    {"id": "chat", "text": "Le chat dort sur le canapé depuis ce matin.", "metadata": {"lang": "fr"}},
]

with Client() as client:
    vectors = client.embed(["hello world", "你好，世界"]).dense
    print("embedded 2 texts:", vectors.shape, f"cosine {float(vectors[0] @ vectors[1]):.3f}")

    docs = client.index("quickstart")
    docs.create(exist_ok=True)                              # bound to the model the server serves
    result = docs.upsert(DOCS)                              # idempotent by id: rerunning changes nothing
    print("upsert:", {k: result[k] for k in ("added", "replaced", "unchanged")})

    for query in ("What is the capital of China?", "vector search library"):
        hits = docs.search(query, top_k=2)
        print(f"{query!r} ->", [(h["id"], round(h["score"], 3)) for h in hits])

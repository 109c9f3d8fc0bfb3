"""Retrieval-augmented answer, every stage on one server: retrieve candidates from an index
(hybrid search with the embedding model), rerank them with the cross-encoder, then ask the
generation model to answer from the best passages and cite their ids.

    python examples/rag_answer.py "Which river flows through Vienna?"
"""

import sys

from embedserve.client import Client

PASSAGES = [
    {"id": "danube", "text": "The Danube flows through Vienna, Bratislava, Budapest and Belgrade."},
    {"id": "seine", "text": "The Seine flows through Paris before it reaches the English Channel."},
    {"id": "thames", "text": "The Thames is the river that flows through London."},
    {"id": "yangtze", "text": "长江是中国最长的河流，流经上海。"},
]

question = sys.argv[1] if len(sys.argv) > 1 else "Which river flows through Vienna?"
with Client() as client:
    kb = client.index("rag-demo")
    kb.create(exist_ok=True)
    kb.upsert(PASSAGES)
    # 4 candidates retrieved, reranked by the server's default reranker, the best 2 kept
    hits = kb.search(question, top_k=2, mode="hybrid", rerank={"candidates": 4})
    context = "\n".join(f"[{h['id']}] {h['text']}" for h in hits)
    messages = [
        {"role": "system", "content": "Answer only from the passages. Cite the passage id in brackets."},
        {"role": "user", "content": f"Passages:\n{context}\n\nQuestion: {question}"},
    ]
    print("retrieved and reranked:", [(h["id"], round(h["scores"]["rerank"], 3)) for h in hits])
    print("answer: ", end="", flush=True)
    for text in client.chat_stream(messages, max_tokens=60, temperature=0):
        print(text, end="", flush=True)
    print()

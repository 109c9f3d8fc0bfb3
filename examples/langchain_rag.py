"""LangChain's own OpenAI classes pointed at embedserve: embed a few passages, retrieve the
closest to a question, and stream an answer.

`check_embedding_ctx_length=False` matters: by default `OpenAIEmbeddings` tokenizes with
tiktoken and sends token ids of OpenAI's vocabulary, which any other model would embed as if
they were its own ids. With it off, LangChain sends the text and the server tokenizes it.

    python examples/langchain_rag.py
"""

import os

import numpy as np
from langchain_openai import ChatOpenAI, OpenAIEmbeddings

base = os.environ.get("EMBEDSERVE_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1"
key = os.environ.get("EMBEDSERVE_API_KEY", "unused")
embeddings = OpenAIEmbeddings(model="multilingual-e5-small", base_url=base, api_key=key,
                              check_embedding_ctx_length=False)
llm = ChatOpenAI(model="SmolLM2-135M-Instruct", base_url=base, api_key=key, temperature=0, max_tokens=60)

passages = ["The Danube flows through Vienna and Budapest.", "Paris lies on the Seine.",
            "The Thames flows through London."]
question = "Which river flows through Budapest?"
doc_vecs = np.array(embeddings.embed_documents(passages))
q_vec = np.array(embeddings.embed_query(question))
best = passages[int(np.argmax(doc_vecs @ q_vec))]
print("retrieved:", best)
for chunk in llm.stream(f"Answer from this passage only.\nPassage: {best}\nQuestion: {question}"):
    print(chunk.content, end="", flush=True)
print()

"""The unmodified `openai` SDK against embedserve: embeddings (float and base64) and a streamed chat.

    python examples/openai_sdk.py
"""

import base64
import os

import numpy as np
from openai import OpenAI

base = os.environ.get("EMBEDSERVE_URL", "http://127.0.0.1:8000").rstrip("/")
client = OpenAI(base_url=base + "/v1", api_key=os.environ.get("EMBEDSERVE_API_KEY", "unused"))
models = {m.id: m for m in client.models.list().data}
embed_model = next(m for m, info in models.items() if getattr(info, "task", None) != "generate")
chat_model = next((m for m, info in models.items() if getattr(info, "task", None) == "generate"), None)

floats = client.embeddings.create(model=embed_model, input=["北京是中国的首都", "Beijing is China's capital"])
a, b = (np.array(d.embedding) for d in floats.data)
print(f"{embed_model}: {len(a)} dimensions, cross-lingual cosine {a @ b:.3f}")

packed = client.embeddings.create(model=embed_model, input="little-endian float32", encoding_format="base64")
vec = np.frombuffer(base64.b64decode(packed.data[0].embedding), dtype="<f4")
print("base64 decoded to", vec.shape, vec.dtype)

if chat_model:
    stream = client.chat.completions.create(model=chat_model, stream=True, max_tokens=40, temperature=0,
                                            messages=[{"role": "user", "content": "Name three rivers of Europe."}])
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()

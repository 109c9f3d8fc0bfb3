"""Model code: our own encoder (BERT / XLM-R), BGE-M3 heads, bundled-model resolution."""

"""Triton kernels for the paged KV cache, each beside a plain-torch reference (see DESIGN.md)."""

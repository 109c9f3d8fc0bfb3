"""embedserve: a self-hosted embedding and retrieval inference service."""

__version__ = "0.1.0"

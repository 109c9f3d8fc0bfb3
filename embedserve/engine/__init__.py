"""Engines: model work on dedicated threads, never on the event loop."""

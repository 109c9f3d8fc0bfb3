"""Benchmark studies, run by hand as tools (`python -m embedserve.studies.<name>`): `make bench`'s
side-by-side run (compare), profiles, the CPU paths side by side, the decoder and reindex studies.

They use only public names of the product, and the product never imports them
(tests/test_layers.py); the load generator they drive, `embedserve bench`, is in embedserve.bench."""

"""The load generator `embedserve bench embed|generate` (the benchmark studies that drive it are
in embedserve.studies)."""

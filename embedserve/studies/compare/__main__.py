"""`python -m embedserve.studies.compare`: what `make bench` runs."""

from . import main

raise SystemExit(main())

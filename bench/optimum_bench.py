"""Exact-solver times (HiGHS MILP) on synthetic GPU and DC instances: `python bench/optimum_bench.py`.

The measurement lives in hsched.optimum.main (also `python -m hsched.optimum`); this is its bench/ entry.
"""

from hsched.optimum import main

if __name__ == "__main__":
    main()

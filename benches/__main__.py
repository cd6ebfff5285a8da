"""`python -m benches`: the load-test harness (CONTRACT §8). Not written yet: see its issue."""

import sys


def main() -> int:
    print("benches: the load-test harness is not written yet (its own issue)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

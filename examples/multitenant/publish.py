"""Publish work for a few tenants: one floods, the others trickle.

python publish.py [--tasks 400]
"""

from __future__ import annotations

import argparse
from collections import Counter

from proj import app, process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=400, help="tasks of the flooding tenant")
    args = parser.parse_args()
    routed: Counter[str] = Counter()
    tenants = ["acme", "initech", "umbrella", "hooli", "stark", "wayne"]
    for i in range(args.tasks):
        # "initech" floods: as many tasks as all the others together, times ten.
        tenant = "initech" if i % 11 else tenants[(i // 11) % len(tenants)]
        result = process.apply_async(kwargs={"tenant_id": tenant, "item": i})
        routed[tenant] += 1
        del result
    print("published per tenant:", dict(routed))
    app.close()


if __name__ == "__main__":
    main()

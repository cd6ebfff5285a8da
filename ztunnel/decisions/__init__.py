"""The connection decisions, pure functions over a state snapshot: `route` (where an outbound
connection goes) and `admit` (whether an inbound one reaches our workload, and how)."""

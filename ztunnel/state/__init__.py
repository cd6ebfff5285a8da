"""The mesh as the proxy knows it (`store`) and the pure decisions on it: `route` for outbound,
`admission` for inbound."""

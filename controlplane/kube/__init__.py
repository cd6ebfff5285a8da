"""The mesh from Kubernetes and Istio objects: istiod's ambient index for `ztunnel control-plane --kube`.

`manifests` reads files into objects, `cluster` indexes them, one module per conversion
(`workloads`, `services`, `endpointslices`, `waypoints`, `policies`), `warnings` says what a user
should fix, `index.build` puts them together into the workloads, services and policies served, and
`source` watches the path. See `docs/kube.md`.
"""

"""The mesh as the proxy and the control plane hold it: workloads and services (`model.py`), and the
local configuration file that describes them (`localconfig.py`, read with `localyaml.py` or
`yamlstream.py`, written back by `render.py`). The wire that carries them is `xds`'s."""

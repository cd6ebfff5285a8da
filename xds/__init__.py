"""The wire side of the control plane: protocol models, the Delta ADS client, the local-file source,
and the conversion of wire (or YAML) resources into the in-memory model of `xds.model`."""

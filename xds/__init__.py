"""The wire side of the control plane: protocol models, the Delta ADS client, and the conversion of
wire resources into the in-memory model of `mesh.model`."""

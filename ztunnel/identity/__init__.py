"""The proxy's identities: workload certificates (the secret manager), the CA client, the
certificate helper process and its work, and the CRL watcher."""

"""The proxy's configuration: `Config` read from the environment (`settings`), the variables
the reference reads (`envvars`), `PROXY_CONFIG` (`proxyconfig`) and the worker count."""

"""The process model of `ztunnel proxy`: one supervisor and N data-plane worker processes, in both
modes.

CPython runs one core per process, so where the reference runs worker threads this runs worker
processes. `ztunnel proxy` is always:

* the parent (`supervisor.py`): the control runtime (`ztunnel/control.py`) and no data plane. It
  alone does the control work: the local config, the one xDS stream, the CA client and the
  certificates (one request per identity), ZDS in in-pod mode, admin (:15000), metrics (:15020) and
  readiness (:15021). It never carries a proxied connection;
* `worker_threads` workers (`worker.py`), each owning only listeners and connections: the proxy
  listeners of the dedicated workload, or in in-pod mode each pod's listeners in the pod's network
  namespace (`pod_proxies.py`) and ztunnel's own HBONE listener, all bound with `SO_REUSEPORT`, so
  the kernel spreads new connections over the workers. A worker never imports the supervisor.

The first workers are forked from the parent before its event loop starts (so before any thread
exists), after the worker body's imports and the control side's (`spawning.py`, `ztunnel/start.py`),
so they share that memory copy-on-write (the control side's pages, which no worker runs, stay
shared); no process exists only to fork them. A replacement is a new interpreter (`replacement.py`): a fork from the running
parent would not be safe.

Parent and worker talk over one `SOCK_SEQPACKET` socket pair (`channel.py`) in small typed
messages (`messages.py`). The parent ships the applied state as changes (`replication.py`),
answers certificate requests, passes each pod's namespace fd (`fleet_pods.py`) and collects the
traffic counters (`counters.py`). Workers never talk to a control plane.

Dedicated mode: before any worker binds, the parent claims every listener address
(`listeners.py`). Readiness, restart backoff and a silent worker are the fleet's
(`fleet.py`): the `proxy` task is pending until every worker's listeners accept, and again whenever
a worker is down: dead, or its loop has not answered the parent's ping for 5 s. A worker that dies
is started again (after 0.5 s, doubling up to 10 s while it keeps dying young); the others keep
serving. In in-pod mode a pod is ACKed only once every running worker has its listeners up, and a
pod delete drains it in every worker. Workers die with the parent (`PR_SET_PDEATHSIG`, and they
stop when their channel closes); the parent drains them on shutdown.
"""

"""The load-test harness: `python -m benches` (benches/README.md).

`topology` starts the processes under test (ztunnels, stunnel, the sink) on loopback, `capture`
the same between network namespaces with iptables capture (`netns` makes them; `ctools` builds
`tools.c`, the C load tools), `loadgen` and `sink` are the harness's own client and application
processes, `matrix` runs the measurements round by round (`paced` the paced load's figure and
its CPU and PSS sampler), `soak` the long run watched for leaks,
`procfs` reads CPU, memory, fds and TIME_WAIT sockets from /proc, `report` prints and saves the
results; `dns` is the DNS proxy's figure.
"""

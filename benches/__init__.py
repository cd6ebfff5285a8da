"""The load-test harness (CONTRACT §8): `python -m benches`.

`topology` starts the processes under test (ztunnels, stunnel, the sink) on loopback, `loadgen`
and `sink` are the harness's own client and application processes, `matrix` runs the measurements
round by round, `procfs` reads CPU and memory from /proc, `report` prints and saves the results.
"""

"""The admin endpoint (`server`) and what it serves beyond state: `explain`, the profiles
(`profiling`), and `ztunnel config`, its command-line client (`configview`)."""

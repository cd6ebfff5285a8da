"""The proxy's logs: the filter, the line formats and access logs (`lines`), and the writer
thread every process puts its lines through (`writer`)."""

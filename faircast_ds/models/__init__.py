"""Models the tests, the jobs and the benchmarks share: tiny and real-architecture builders
(``builders``)."""

"""The studies: accuracy against the budget (`eval`), throughput and memory (`bench`, its GPU study), the
serving load generator, and the helpers they share (`report`, `data`). Not imported by the library."""

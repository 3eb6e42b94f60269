"""Where and how networks run: device and precision policy, memory probes, batching with
out-of-memory back-off, the batch-size profiler, the long-lived worker, cancellation, allocator set-up."""

"""The runtime that runs the template batch by batch: the pipeline loop (the owner of a running
pipeline's mutable state), the JobGenerator and ReceiverTracker, the JobScheduler, the durable
per-batch logs and the pipeline's checkpoint directory."""

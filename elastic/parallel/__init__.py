"""The (dp, pp) topology and the parallelism strategies (DDP, FSDP2, pipeline), re-sharding."""

"""The shard's servers: the ``ShardService`` gRPC handlers and the step channel, both in
front of one ``StepExecutor``; with tensor parallelism, what each rank serves
(``tensor_parallel``)."""

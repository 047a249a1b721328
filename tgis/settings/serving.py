"""Settings of what is served and where: the model and its files, the processes, their
sockets and ports, TLS, logs, tracing, the OpenAI routes and the process lifetimes."""

from __future__ import annotations

from tgis.settings.declaration import UNSET, Kind, Process, Via
from tgis.settings.declaration import setting as _s

L, R, S = Process.LAUNCHER, Process.ROUTER, Process.SHARD

DEFAULT_UDS_PATH = "/tmp/text-generation-server"
DEFAULT_SHUTDOWN_GRACE_S = 25.0
"""How long in-flight requests may run after SIGTERM: Kubernetes' default
terminationGracePeriodSeconds (30) less a margin for stopping the processes."""
DEFAULT_OTLP_SERVICE_NAME = "text-generation-inference.router"
"""TGIS's OpenTelemetry service.name for the router."""
DEFAULT_DISTRIBUTED_TIMEOUT_S = 120.0
"""Joining the tensor-parallel group, and any one tensor collective, must finish within
this (seconds)."""
DEFAULT_STEP_TIMEOUT_S = 600.0
"""How long one step may run before the shard is taken as hung: far above any real step
(a full 4,096-token prefill of an 8B model takes about a minute even on a CPU)."""
DEFAULT_STREAM_STALL_TIMEOUT_S = 60.0
"""How long one streamed message may wait for a client that does not read."""
LOAD_FORMATS = ("auto", "dummy")
"""How the weights are obtained: read from the model's safetensors files, or created at
random from config.json alone (vLLM's name; for benchmarks without the real weights)."""
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "granite")
"""The tool-call formats the OpenAI routes read (``router/edge/openai_tool_parsers.py``)."""


MODEL = (
    _s("model_name", ("--model-name", "--model-id"), ("MODEL_NAME", "MODEL_ID"), Kind.STR, None,
       "Model id in the local HF cache, or a directory with config.json (default: the "
       "embedded demo model, with a warning).", {L, S}, defaults={S: ""}, positional={S},
       aliases={"--model-id": "TGI", "MODEL_ID": "TGI"}),
    _s("require_model", ("--require-model",), ("TGIS_REQUIRE_MODEL",), Kind.FLAG, False,
       "Refuse to start when no model is named, instead of serving the embedded demo model "
       "(the container image sets it).", {L}),
    _s("trust_remote_code", ("--trust-remote-code",), ("TRUST_REMOTE_CODE",), Kind.FLAG, False,
       "Let transformers run the model repository's own code (the transformers fallback's "
       "model, and a tokenizer the launcher converts).", {L, S}),
    _s("revision", ("--revision",), ("REVISION",), Kind.STR, None,
       "Hub revision/branch of the model.", {L, S}),
    _s("deployment_framework", ("--deployment-framework",), ("DEPLOYMENT_FRAMEWORK",), Kind.STR,
       "hf_transformers", "Inference engine (hf_custom_tp is a deprecated name of tgis_native).",
       {L, S}, defaults={S: None}, positional={S}),
    _s("dtype", ("--dtype",), ("DTYPE",), Kind.STR, None,
       "auto, float32, float16 or bfloat16 (or fp32/float, fp16/half, bf16).", {L, S}),
    _s("dtype_str", ("--dtype-str",), ("DTYPE_STR",), Kind.STR, None, "Alias of --dtype.", {L}),
    _s("quantize", ("--quantize",), ("QUANTIZE",), Kind.STR, None,
       "gptq, awq, compressed-tensors, fp8, int8 (bitsandbytes, eetq: int8); checked against "
       "the checkpoint's quantization_config.", {L, S}),
    _s("load_format", ("--load-format",), ("LOAD_FORMAT",), Kind.STR, "auto",
       "auto: read the model's safetensors weights; dummy: random weights created on the "
       "device from config.json alone, for benchmarks without the real weights (native models "
       "only; the tokenizer is still needed).", {L, S}, choices=LOAD_FORMATS),
    _s("served_model_name", ("--served-model-name",), ("SERVED_MODEL_NAME",), Kind.STR, None,
       "The model id of the OpenAI routes (/v1/models; default: --model-name).", {L, R},
       defaults={R: ""}),
    _s("model_dir", ("--model-dir",), ("MODEL_DIR",), Kind.STR, None,
       "The model's directory: chat_template.jinja and tokenizer_config.json are read there.",
       {R}, internal=True),
    _s("tokenizer_path", ("--tokenizer-path",), ("TOKENIZER_PATH",), Kind.STR, UNSET,
       "The model's tokenizer.json.", {R}, internal=True),
    _s("chat_template", ("--chat-template",), ("CHAT_TEMPLATE",), Kind.STR, None,
       "The chat template of /v1/chat/completions: a file, or the template itself (default: "
       "chat_template.jinja or tokenizer_config.json in the model directory).", {L, R}),
    _s("tool_call_parser", ("--tool-call-parser",), ("TOOL_CALL_PARSER",), Kind.STR, None,
       "The format of the model's own tool calls on /v1/chat/completions (tool_choice "
       "auto): hermes, llama3_json or granite (default: the one the chat template asks "
       "for, else hermes).", {L, R}, choices=TOOL_CALL_PARSERS,
       aliases={"--tool-call-parser": "vLLM"}),
)  # fmt: skip

PROCESSES = (
    _s("num_shard", ("--num-shard",), ("NUM_SHARD",), Kind.INT, None,
       "Number of shards (default: NUM_GPUS, else the visible CUDA devices, else 1).", {L}),
    _s("sharded", ("--sharded",), ("SHARDED",), Kind.FLAG, False,
       "One rank of several (RANK and WORLD_SIZE in the environment).", {S}, internal=True),
    _s("shard_uds_path", ("--shard-uds-path", "--uds-path"), ("SHARD_UDS_PATH",), Kind.STR,
       DEFAULT_UDS_PATH, "Shard socket prefix; shard r listens on <path>-<r>.", {L, S}),
    _s("master_shard_uds_path", ("--master-shard-uds-path",), ("MASTER_SHARD_UDS_PATH",),
       Kind.STR, DEFAULT_UDS_PATH + "-0", "The socket of shard 0, which the router talks to.",
       {R}, internal=True),
    _s("master_addr", ("--master-addr",), ("MASTER_ADDR", "LWS_LEADER_ADDRESS"), Kind.STR,
       "localhost", "Address of rank 0 for the tensor-parallel group.", {L},
       aliases={"LWS_LEADER_ADDRESS": "LeaderWorkerSet"}),
    _s("master_port", ("--master-port",), ("MASTER_PORT",), Kind.INT, 29500,
       "Port of rank 0 for the tensor-parallel group; with --nnodes above 1 the launchers "
       "also link on the next port.", {L}),
    _s("nnodes", ("--nnodes",), ("NNODES", "LWS_GROUP_SIZE"), Kind.INT, 1,
       "Nodes the --num-shard ranks are spread over, num_shard / nnodes on each; node 0 "
       "runs the router.", {L}, aliases={"LWS_GROUP_SIZE": "LeaderWorkerSet"}, minimum=1),
    _s("node_rank", ("--node-rank",), ("NODE_RANK", "LWS_WORKER_INDEX"), Kind.INT, 0,
       "This node's place among --nnodes: it runs ranks node_rank * num_shard / nnodes "
       "onwards.", {L}, aliases={"LWS_WORKER_INDEX": "LeaderWorkerSet"}, minimum=0),
    _s("distributed_timeout", ("--distributed-timeout",), ("TGIS_DISTRIBUTED_TIMEOUT_S",),
       Kind.FLOAT, DEFAULT_DISTRIBUTED_TIMEOUT_S,
       "Seconds a shard may take to join its tensor-parallel group, and any one collective.",
       {S}, minimum=0.0),
    _s("shard_startup_timeout", ("--shard-startup-timeout",), ("SHARD_STARTUP_TIMEOUT",),
       Kind.FLOAT, 600.0, "Seconds to wait for every shard to become ready.", {L}),
    _s("shard_connect_timeout", ("--shard-connect-timeout",), ("SHARD_CONNECT_TIMEOUT",),
       Kind.FLOAT, 60.0, "Seconds the router waits for shard 0 to answer.", {R}),
    _s("shutdown_grace_period", ("--shutdown-grace-period",), ("SHUTDOWN_GRACE_PERIOD",),
       Kind.FLOAT, DEFAULT_SHUTDOWN_GRACE_S,
       "Seconds in-flight requests may run after SIGTERM while new ones are refused and "
       "health reports NOT_SERVING (Kubernetes' terminationGracePeriodSeconds of 30 less a "
       "margin; raise both together).", {L, R}, minimum=0.0),
    _s("tokenization_workers", ("--tokenization-workers",), ("TOKENIZATION_WORKERS",),
       Kind.INT, None, "Tokenizer threads (default: the CPUs less one, 1 to 8).", {R},
       minimum=1),
    _s("pipeline_depth", ("--pipeline-depth",), ("TGIS_PIPELINE_DEPTH",), Kind.INT, 2,
       "Steps in flight: 2 plans and sends the next step while one runs (overlap); 1 is the "
       "serial loop (a reference for debugging).", {R}, minimum=1),
    _s("step_timeout", ("--step-timeout",), ("TGIS_STEP_TIMEOUT",), Kind.FLOAT,
       DEFAULT_STEP_TIMEOUT_S,
       "Seconds the shard may take to answer one step; past them it is taken as hung: "
       "requests fail, the router exits non-zero and the launcher stops.", {R}, minimum=0.0),
    _s("stream_stall_timeout", ("--stream-stall-timeout",), ("TGIS_STREAM_STALL_TIMEOUT",),
       Kind.FLOAT, DEFAULT_STREAM_STALL_TIMEOUT_S,
       "Seconds a streamed message may wait for a client that does not read; then the "
       "stream is cancelled, freeing its request and permit.", {R}, minimum=0.0),
)  # fmt: skip

NETWORK = (
    _s("hostname", ("--hostname",), (), Kind.STR, None,
       "The address the HTTP and gRPC ports listen on (default: every interface, IPv4 and "
       "IPv6). No variable: HOSTNAME, TGI's, is every container's own name.", {L, R},
       aliases={"--hostname": "TGI"}),
    _s("port", ("-p", "--port"), ("PORT",), Kind.INT, 3000,
       "HTTP port (/health, /metrics, the /v1 routes).", {L, R}),
    _s("grpc_port", ("-g", "--grpc-port"), ("GRPC_PORT",), Kind.INT, 8033, "gRPC port.",
       {L, R}),
    _s("tls_cert_path", ("--tls-cert-path",), ("TLS_CERT_PATH",), Kind.STR, None,
       "PEM certificate of the gRPC port (TLS).", {L, R}),
    _s("tls_key_path", ("--tls-key-path",), ("TLS_KEY_PATH",), Kind.STR, None,
       "PEM private key of --tls-cert-path.", {L, R}),
    _s("tls_client_ca_cert_path", ("--tls-client-ca-cert-path",), ("TLS_CLIENT_CA_CERT_PATH",),
       Kind.STR, None, "CA bundle that client certificates must chain to (mTLS).", {L, R}),
    _s("http_tls", ("--http-tls",), ("HTTP_TLS",), Kind.FLAG, False,
       "Serve the HTTP port (/health, /metrics, /v1) over TLS with the gRPC port's cert and "
       "key.", {L, R}),
    _s("api_key", ("--api-key",), ("API_KEY",), Kind.STR, None,
       "A bearer token the /v1 routes and TGI's generation routes require (Authorization: "
       "Bearer <key>).", {L, R}, via=Via.ENV),
    _s("cors_allow_origin", ("--cors-allow-origin",), ("CORS_ALLOW_ORIGIN",), Kind.LIST, (),
       "Origins whose browser pages may call the HTTP routes (CORS), the flag repeated or "
       "comma-separated; * for any (default: none).", {L, R}),
    _s("json_output", ("--json-output",), ("JSON_OUTPUT",), Kind.FLAG, False,
       "JSON log lines, one object per record.", {L, R, S}),
    _s("otlp_endpoint", ("--otlp-endpoint",), ("OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
       Kind.STR, None,
       "OpenTelemetry OTLP/gRPC collector (e.g. http://otel-collector:4317): the router "
       "exports a span per request with validation, queue and inference spans.", {L, R},
       aliases={"OTEL_EXPORTER_OTLP_ENDPOINT": "OpenTelemetry"}),
    _s("otlp_service_name", ("--otlp-service-name",), ("OTLP_SERVICE_NAME", "OTEL_SERVICE_NAME"),
       Kind.STR, DEFAULT_OTLP_SERVICE_NAME, "service.name of the router's spans.", {L, R},
       aliases={"OTEL_SERVICE_NAME": "OpenTelemetry"}),
)  # fmt: skip

SETTINGS = (*MODEL, *PROCESSES, *NETWORK)

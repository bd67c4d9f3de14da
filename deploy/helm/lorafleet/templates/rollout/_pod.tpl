{{/*
SGLang loads an adapter only if every target is in --lora-target-modules, compared after its
own normalisation (q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj; a dotted name by its
last part): srt/lora/utils.py get_normalized_target_modules, mem_pool.py can_support; otherwise
/load_lora_adapter answers 400. The Tinker SDK's create_lora_training_client defaults
(train_attn, train_mlp, train_unembed all true) adapt every attention and MLP projection and
lm_head (MoE experts: gate_up_proj and down_proj under SGLang's names), so a profile that
cannot load that adapter refuses every default training run: fail at render time instead.
*/}}
{{- define "lorafleet.rollout.checkSglangTargets" -}}
{{- $modules := . -}}
{{- if not (has "all" $modules) -}}
{{- $fused := dict "q_proj" "qkv_proj" "k_proj" "qkv_proj" "v_proj" "qkv_proj" "gate_proj" "gate_up_proj" "up_proj" "gate_up_proj" -}}
{{- $normalized := list -}}
{{- range $modules -}}
{{- $base := last (splitList "." .) -}}
{{- $normalized = append $normalized (get $fused $base | default $base) -}}
{{- end -}}
{{- $missing := list -}}
{{- range list "qkv_proj" "o_proj" "gate_up_proj" "down_proj" "lm_head" -}}
{{- if not (has . $normalized) -}}
{{- $missing = append $missing . -}}
{{- end -}}
{{- end -}}
{{- if $missing -}}
{{- fail (printf "rollout.sglang.loraTargetModules %v cannot load the SDK's default adapter (train_attn, train_mlp, train_unembed): missing %s; use [all] or add them" $modules (join ", " $missing)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
A model server container's loopback health probe (GET /health), for SGLang and vLLM alike.
*/}}
{{- define "lorafleet.rollout.serverProbes" -}}
{{- $probe := printf "import urllib.request; urllib.request.urlopen('http://127.0.0.1:%d/health', timeout=%d)" (int .port) (int .probes.liveness.timeoutSeconds) -}}
startupProbe:
  exec:
    command: [python3, -c, {{ $probe | quote }}]
  {{- toYaml .probes.startup | nindent 2 }}
livenessProbe:
  exec:
    command: [python3, -c, {{ $probe | quote }}]
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end -}}

{{/*
The rollout pod spec. role: "single" (a StatefulSet pod), "leader" or "worker" (the pods of
one LeaderWorkerSet group: one SGLang server spread over `size` nodes, tensor/pipeline
parallel; the leader also runs the lorafleet rollout container, workers only SGLang).
With engine sglang or vllm the model server runs as a second container of the pod, on
loopback, and holds the GPUs; with engine torch the rollout container does.
*/}}
{{- define "lorafleet.rollout.podSpec" -}}
{{- $ := .ctx -}}
{{- $c := dict "ctx" $ "component" "rollout" -}}
{{- $v := $.Values.rollout -}}
{{- $s := $v.sglang -}}
{{- $vl := $v.vllm -}}
{{- $lws := $v.leaderWorkerSet -}}
{{- $sglang := eq $v.engine "sglang" -}}
{{- $vllm := eq $v.engine "vllm" -}}
{{- if and (eq $.Values.model.quantization "int8") (or $sglang $vllm) -}}
{{- fail "model.quantization int8 is served by the torch engine only: SGLang and vLLM quantize a float checkpoint to fp8, not int8 weight-only (use fp8, or rollout.engine torch)" -}}
{{- end -}}
{{- if $sglang -}}
{{- if gt (int $v.numSlots) (int $s.maxLoadedLoras) -}}
{{- fail "rollout.numSlots must be <= rollout.sglang.maxLoadedLoras: the SGLang server loads at most that many at once (the rollout evicts before it would)" -}}
{{- end -}}
{{- include "lorafleet.rollout.checkSglangTargets" $s.loraTargetModules -}}
{{- end -}}
{{- $serverRank := 0 -}}
{{- if $sglang -}}{{- $serverRank = int $s.maxLoraRank -}}{{- end -}}
{{- if $vllm -}}{{- $serverRank = int $vl.maxLoraRank -}}{{- end -}}
{{- $rank := $v.settings.maxLoraRank -}}
{{- if and $serverRank (not (kindIs "invalid" $rank)) (gt (int $rank) $serverRank) -}}
{{- fail (printf "rollout.settings.maxLoraRank (%d) must be <= rollout.%s.maxLoraRank (%d): the rollout would accept adapters its server cannot load" (int $rank) $v.engine $serverRank) -}}
{{- end -}}
{{- if $vllm -}}
{{- if gt (int $vl.maxLoras) (int $vl.maxCpuLoras) -}}
{{- fail "rollout.vllm.maxCpuLoras must be >= rollout.vllm.maxLoras" -}}
{{- end -}}
{{- if gt (int $v.numSlots) (int $vl.maxCpuLoras) -}}
{{- fail "rollout.numSlots must be <= rollout.vllm.maxCpuLoras: the vLLM server holds every resident adapter" -}}
{{- end -}}
{{- end -}}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
securityContext:
  {{- include "lorafleet.podSecurityContext" $ | nindent 2 }}
{{ include "lorafleet.scheduling" (dict "ctx" $ "v" $v) }}
containers:
  {{- if ne .role "worker" }}
  - name: rollout
    image: {{ include "lorafleet.image" $c }}
    imagePullPolicy: {{ $.Values.image.pullPolicy }}
    command: [python, -m, lorafleet_rollout]
    {{- with $v.extraArgs }}
    args:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    ports:
      - {name: grpc, containerPort: {{ $v.port }}, protocol: TCP}
      - {name: metrics, containerPort: {{ $v.metricsPort }}, protocol: TCP}
      {{- with include "lorafleet.healthContainerPort" (dict "ctx" $ "v" $v) }}{{ . | nindent 6 }}{{ end }}
    env:
      {{- include "lorafleet.commonEnv" (dict "ctx" $ "prefix" "LORAFLEET_ROLLOUT_" "v" $v) | nindent 6 }}
      - name: LORAFLEET_ROLLOUT_ENGINE
        value: {{ $v.engine | quote }}
      {{- if and $serverRank (kindIs "invalid" $rank) }}
      # The largest rank the rollout accepts is what its server loads (settings.maxLoraRank
      # may lower it): the rollout refuses a larger adapter itself, naming its rank, and
      # reports that maximum to the controller.
      - name: LORAFLEET_ROLLOUT_MAX_LORA_RANK
        value: {{ $serverRank | quote }}
      {{- end }}
      {{- if $sglang }}
      - name: LORAFLEET_ROLLOUT_ENGINE_URL
        value: {{ printf "http://127.0.0.1:%d" (int $s.port) | quote }}
      {{- else if $vllm }}
      - name: LORAFLEET_ROLLOUT_ENGINE_URL
        value: {{ printf "http://127.0.0.1:%d" (int $vl.port) | quote }}
      - name: LORAFLEET_ROLLOUT_SERVED_MODEL_NAME
        value: {{ $vl.servedModelName | quote }}
      {{- end }}
      - name: LORAFLEET_ROLLOUT_MODEL_PATH
        value: {{ include "lorafleet.modelPath" $ | quote }}
      - name: LORAFLEET_ROLLOUT_BASE_MODEL_NAME
        value: {{ $.Values.model.name | quote }}
      - name: LORAFLEET_ROLLOUT_QUANTIZATION
        value: {{ $.Values.model.quantization | quote }}
      - name: LORAFLEET_ROLLOUT_MAX_LOADED_ADAPTERS
        value: {{ $v.numSlots | quote }}
      - name: LORAFLEET_ROLLOUT_MAX_STORED_ADAPTERS
        value: {{ $v.maxStoredAdapters | quote }}
      # Pushed adapters (the service adds its replica id): on the checkpoint volume, which the
      # SGLang or vLLM container (and, multi-node, every pod of the group) reads them from by path.
      - name: LORAFLEET_ROLLOUT_ADAPTER_DIR
        value: {{ include "lorafleet.rolloutAdapterDir" $ | quote }}
      {{- if eq $.Values.checkpoints.mode "shared" }}
      - name: LORAFLEET_ROLLOUT_SHARED_ADAPTER_ROOT
        value: {{ include "lorafleet.sharedAdapterRoot" $ | quote }}
      {{- end }}
      - name: LORAFLEET_ROLLOUT_CONTROLLER_ADDRESS
        value: {{ include "lorafleet.controllerAddress" $ | quote }}
      - name: LORAFLEET_ROLLOUT_ADVERTISE_ADDRESS
        {{- if eq .role "single" }}
        value: {{ include "lorafleet.advertiseAddress" (dict "ctx" $ "component" "rollout" "prefix" "LORAFLEET_ROLLOUT_" "port" $v.port) | quote }}
        {{- else }}
        # The leader's DNS name under the group's headless Service (created by LWS).
        value: {{ printf "$(LORAFLEET_ROLLOUT_REPLICA_ID).%s-group.%s.svc:%d" (include "lorafleet.componentName" $c) $.Release.Namespace (int $v.port) | quote }}
        {{- end }}
      {{- with $v.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- include "lorafleet.grpcProbes" (dict "ctx" $ "v" $v "service" "lorafleet.v1.RolloutService") | nindent 4 }}
    resources:
      {{- if or $sglang $vllm }}
      {{- toYaml $v.resources | nindent 6 }}
      {{- else }}
      {{- include "lorafleet.gpuResources" (dict "ctx" $ "resources" $v.resources "gpu" $v.gpu) | nindent 6 }}
      {{- end }}
    securityContext:
      {{- include "lorafleet.containerSecurityContext" $ | nindent 6 }}
    # Every tenant's checkpoints and the shared adapter root read-only; writable only the
    # folder of the adapters pushed to this rollout (a subPath of the same volume, so its
    # server sees them at the same path).
    volumeMounts:
      {{- include "lorafleet.workerMounts" (dict "ctx" $ "v" $v "checkpointsReadOnly" true) | nindent 6 }}
      - name: checkpoints
        mountPath: {{ include "lorafleet.rolloutAdapterDir" $ }}
        subPath: rollout-adapters
      {{- with include "lorafleet.tlsMount" $ }}{{ . | nindent 6 }}{{ end }}
      {{- with $v.extraVolumeMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
  {{- end }}
  {{- if $sglang }}
  # The SGLang server: loopback only, so its admin routes (adapter loading, weight
  # updates) are reachable from the rollout container alone. It reads adapters by path
  # from the checkpoint volume, hence the same mounts.
  - name: sglang
    image: {{ include "lorafleet.thirdPartyImage" $s.image }}
    imagePullPolicy: {{ $s.image.pullPolicy }}
    command:
      - python3
      - -m
      - sglang.launch_server
      - --model-path={{ include "lorafleet.modelPath" $ }}
      - --host=127.0.0.1
      - --port={{ $s.port }}
      - --enable-lora
      - --max-lora-rank={{ $s.maxLoraRank }}
      - --lora-target-modules
      {{- range $s.loraTargetModules }}
      - {{ . }}
      {{- end }}
      - --max-loras-per-batch={{ $s.maxLorasPerBatch }}
      - --max-loaded-loras={{ $s.maxLoadedLoras }}
      - --lora-backend={{ $s.loraBackend }}
      - --tp-size={{ $s.tpSize }}
      {{- if gt (int $s.ppSize) 1 }}
      - --pp-size={{ $s.ppSize }}
      {{- end }}
      {{- if ne .role "single" }}
      # One server over the group's nodes; node 0 (the leader) serves HTTP.
      - --nnodes={{ $lws.size }}
      - --node-rank=$(LWS_WORKER_INDEX)
      - --dist-init-addr=$(LWS_LEADER_ADDRESS):{{ $lws.distInitPort }}
      {{- end }}
      {{- if $s.memFractionStatic }}
      - --mem-fraction-static={{ $s.memFractionStatic }}
      {{- end }}
      {{- if $s.deterministicInference }}
      # Honours each request's sampling_seed (ignored without it); cost: values.yaml.
      - --enable-deterministic-inference
      {{- end }}
      - --enable-metrics
      {{- if eq $.Values.model.quantization "fp8" }}
      # The trainer's "fp8" base: SGLang's online per-matrix e4m3 weights (lorafleet.quantize).
      - --quantization=fp8
      {{- end }}
      {{- with $s.extraArgs }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if eq .role "leader" }}
    ports:
      - {name: dist-init, containerPort: {{ $lws.distInitPort }}, protocol: TCP}
    {{- end }}
    env:
      # Caches (triton, flashinfer JIT, HF) go to /tmp: the root filesystem is read-only.
      - {name: HOME, value: /tmp}
      - {name: XDG_CACHE_HOME, value: /tmp/.cache}
      - {name: TRITON_CACHE_DIR, value: /tmp/.triton}
      - {name: HF_HUB_OFFLINE, value: "1"}
      - {name: PYTHONUNBUFFERED, value: "1"}
      # Logprobs before temperature scaling, as the trainer computes them (RL losses need
      # them unscaled); without it SGLang divides the logits by the temperature first.
      - {name: SGLANG_RETURN_ORIGINAL_LOGPROB, value: "1"}
      {{- with $s.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if ne .role "worker" }}
    {{- include "lorafleet.rollout.serverProbes" $s | nindent 4 }}
    {{- end }}
    resources:
      {{- include "lorafleet.gpuResources" (dict "ctx" $ "resources" $s.resources "gpu" $v.gpu) | nindent 6 }}
    securityContext:
      {{- include "lorafleet.containerSecurityContext" $ | nindent 6 }}
    volumeMounts:
      {{- include "lorafleet.workerMounts" (dict "ctx" $ "v" $v "checkpointsReadOnly" true) | nindent 6 }}
  {{- end }}
  {{- if $vllm }}
  # The vLLM server: loopback only (its /v1/load_lora_adapter is an admin route), reading
  # adapters by path from the checkpoint volume. Flags and env are what VLLMEngine drives:
  # runtime LoRA loading, the base model under servedModelName. lm_head LoRA needs no flag
  # (vLLM wraps lm_head for models that declare it, e.g. Llama, Qwen3, Qwen3-MoE).
  - name: vllm
    image: {{ include "lorafleet.thirdPartyImage" $vl.image }}
    imagePullPolicy: {{ $vl.image.pullPolicy }}
    command:
      - python3
      - -m
      - vllm.entrypoints.openai.api_server
      - --model={{ include "lorafleet.modelPath" $ }}
      - --served-model-name={{ $vl.servedModelName }}
      - --host=127.0.0.1
      - --port={{ $vl.port }}
      - --enable-lora
      - --max-lora-rank={{ $vl.maxLoraRank }}
      - --max-loras={{ $vl.maxLoras }}
      - --max-cpu-loras={{ $vl.maxCpuLoras }}
      - --tensor-parallel-size={{ $vl.tpSize }}
      {{- if $vl.gpuMemoryUtilization }}
      - --gpu-memory-utilization={{ $vl.gpuMemoryUtilization }}
      {{- end }}
      {{- if eq $.Values.model.quantization "fp8" }}
      - --quantization=fp8
      {{- end }}
      {{- with $vl.extraArgs }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    env:
      # Caches (torch.compile, triton, HF) go to /tmp: the root filesystem is read-only.
      - {name: HOME, value: /tmp}
      - {name: XDG_CACHE_HOME, value: /tmp/.cache}
      - {name: TRITON_CACHE_DIR, value: /tmp/.triton}
      - {name: HF_HUB_OFFLINE, value: "1"}
      - {name: VLLM_NO_USAGE_STATS, value: "1"}
      # /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with this set.
      - {name: VLLM_ALLOW_RUNTIME_LORA_UPDATING, value: "True"}
      {{- with $vl.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- include "lorafleet.rollout.serverProbes" $vl | nindent 4 }}
    resources:
      {{- include "lorafleet.gpuResources" (dict "ctx" $ "resources" $vl.resources "gpu" $v.gpu) | nindent 6 }}
    securityContext:
      {{- include "lorafleet.containerSecurityContext" $ | nindent 6 }}
    volumeMounts:
      {{- include "lorafleet.workerMounts" (dict "ctx" $ "v" $v "checkpointsReadOnly" true) | nindent 6 }}
  {{- end }}
volumes:
  {{- include "lorafleet.workerVolumes" (dict "ctx" $ "v" $v) | nindent 2 }}
  {{- if ne .role "worker" }}
  {{- with include "lorafleet.tlsVolume" $c }}{{ . | nindent 2 }}{{ end }}
  {{- end }}
{{- end -}}

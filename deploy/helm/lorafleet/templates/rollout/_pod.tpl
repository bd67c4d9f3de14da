{{/*
The rollout pod spec. role: "single" (a StatefulSet pod), "leader" or "worker" (the pods of
one LeaderWorkerSet group: one SGLang server spread over `size` nodes, tensor/pipeline
parallel; the leader also runs the lorafleet rollout container, workers only SGLang).
*/}}
{{- define "lorafleet.rollout.podSpec" -}}
{{- $ := .ctx -}}
{{- $c := dict "ctx" $ "component" "rollout" -}}
{{- $v := $.Values.rollout -}}
{{- $s := $v.sglang -}}
{{- $lws := $v.leaderWorkerSet -}}
{{- $sglang := eq $v.engine "sglang" -}}
{{- if and $sglang (gt (int $v.numSlots) (int $s.maxLoadedLoras)) -}}
{{- fail "rollout.numSlots must be <= rollout.sglang.maxLoadedLoras: the SGLang server holds every resident adapter" -}}
{{- end -}}
{{- $probe := printf "import urllib.request; urllib.request.urlopen('http://127.0.0.1:%d/health', timeout=%d)" (int $s.port) (int $s.probes.liveness.timeoutSeconds) -}}
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
      {{- if $sglang }}
      - name: LORAFLEET_ROLLOUT_ENGINE_URL
        value: {{ printf "http://127.0.0.1:%d" (int $s.port) | quote }}
      {{- end }}
      - name: LORAFLEET_ROLLOUT_MODEL_PATH
        value: {{ include "lorafleet.modelPath" $ | quote }}
      - name: LORAFLEET_ROLLOUT_BASE_MODEL_NAME
        value: {{ $.Values.model.name | quote }}
      - name: LORAFLEET_ROLLOUT_MAX_LOADED_ADAPTERS
        value: {{ $v.numSlots | quote }}
      # Pushed adapters (the service adds its replica id): on the checkpoint volume, which the
      # SGLang container (and, multi-node, every pod of the group) reads them from by path.
      - name: LORAFLEET_ROLLOUT_ADAPTER_DIR
        value: {{ printf "%s/rollout-adapters" (trimSuffix "/" $.Values.checkpoints.mountPath) | quote }}
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
      {{- if $sglang }}
      {{- toYaml $v.resources | nindent 6 }}
      {{- else }}
      {{- include "lorafleet.gpuResources" (dict "ctx" $ "resources" $v.resources "gpu" $v.gpu) | nindent 6 }}
      {{- end }}
    securityContext:
      {{- include "lorafleet.containerSecurityContext" $ | nindent 6 }}
    volumeMounts:
      {{- include "lorafleet.workerMounts" (dict "ctx" $ "v" $v) | nindent 6 }}
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
      - --enable-metrics
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
      {{- with $s.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if ne .role "worker" }}
    startupProbe:
      exec:
        command: [python3, -c, {{ $probe | quote }}]
      {{- toYaml $s.probes.startup | nindent 6 }}
    livenessProbe:
      exec:
        command: [python3, -c, {{ $probe | quote }}]
      {{- toYaml $s.probes.liveness | nindent 6 }}
    {{- end }}
    resources:
      {{- include "lorafleet.gpuResources" (dict "ctx" $ "resources" $s.resources "gpu" $v.gpu) | nindent 6 }}
    securityContext:
      {{- include "lorafleet.containerSecurityContext" $ | nindent 6 }}
    volumeMounts:
      {{- include "lorafleet.workerMounts" (dict "ctx" $ "v" $v) | nindent 6 }}
  {{- end }}
volumes:
  {{- include "lorafleet.workerVolumes" (dict "ctx" $ "v" $v) | nindent 2 }}
  {{- if ne .role "worker" }}
  {{- with include "lorafleet.tlsVolume" $c }}{{ . | nindent 2 }}{{ end }}
  {{- end }}
{{- end -}}

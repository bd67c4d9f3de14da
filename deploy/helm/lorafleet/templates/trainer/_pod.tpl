{{/*
The trainer pod spec. role: "single" (a StatefulSet pod: one replica, gpusPerReplica ranks
under torchrun when > 1), "leader" or "worker" (the pods of one LeaderWorkerSet group: a
multi-node trainer group, node rank = LWS_WORKER_INDEX, rank 0 on the leader serves gRPC).
*/}}
{{- define "lorafleet.trainer.podSpec" -}}
{{- $ := .ctx -}}
{{- $c := dict "ctx" $ "component" "trainer" -}}
{{- $v := $.Values.trainer -}}
{{- $lws := $v.leaderWorkerSet -}}
{{- $gpus := int $v.gpusPerReplica -}}
{{- $gpu := ternary (dict "count" $gpus "resourceName" $v.gpu.resourceName) $v.gpu (gt $gpus 1) -}}
{{- $serves := ne .role "worker" -}}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
securityContext:
  {{- include "lorafleet.podSecurityContext" $ | nindent 2 }}
{{ include "lorafleet.scheduling" (dict "ctx" $ "v" $v) }}
containers:
  - name: trainer
    image: {{ include "lorafleet.image" $c }}
    imagePullPolicy: {{ $.Values.image.pullPolicy }}
    {{- if eq .role "single" }}
    {{- if gt $gpus 1 }}
    # One replica = gpusPerReplica ranks (lorafleet_trainer.group): FSDP-sharded base.
    command: [torchrun, --standalone, --nnodes=1, --nproc-per-node={{ $gpus }}, -m, lorafleet_trainer]
    {{- else }}
    command: [python, -m, lorafleet_trainer]
    {{- end }}
    {{- else }}
    # One replica = this LeaderWorkerSet group: size pods x gpusPerReplica ranks.
    command:
      - torchrun
      - --nnodes={{ $lws.size }}
      - --nproc-per-node={{ $gpus }}
      - --node-rank=$(LWS_WORKER_INDEX)
      - --master-addr=$(LWS_LEADER_ADDRESS)
      - --master-port={{ $lws.masterPort }}
      - -m
      - lorafleet_trainer
    {{- end }}
    {{- with $v.extraArgs }}
    args:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    ports:
      {{- if $serves }}
      - {name: grpc, containerPort: {{ $v.port }}, protocol: TCP}
      {{- end }}
      - {name: metrics, containerPort: {{ $v.metricsPort }}, protocol: TCP}
      {{- if $serves }}
      {{- with include "lorafleet.healthContainerPort" (dict "ctx" $ "v" $v) }}{{ . | nindent 6 }}{{ end }}
      {{- end }}
      {{- if eq .role "leader" }}
      - {name: torch-master, containerPort: {{ $lws.masterPort }}, protocol: TCP}
      {{- end }}
    env:
      {{- include "lorafleet.commonEnv" (dict "ctx" $ "prefix" "LORAFLEET_TRAINER_" "v" $v) | nindent 6 }}
      - name: LORAFLEET_TRAINER_MODEL_PATH
        value: {{ include "lorafleet.modelPath" $ | quote }}
      - name: LORAFLEET_TRAINER_BASE_MODEL_NAME
        value: {{ $.Values.model.name | quote }}
      - name: LORAFLEET_TRAINER_QUANTIZATION
        value: {{ $.Values.model.quantization | quote }}
      - name: LORAFLEET_TRAINER_NUM_SLOTS
        value: {{ $v.numSlots | quote }}
      - name: LORAFLEET_TRAINER_STORAGE_ROOT
        value: {{ $.Values.checkpoints.mountPath | quote }}
      {{- if eq $.Values.checkpoints.mode "shared" }}
      - name: LORAFLEET_TRAINER_SHARED_ADAPTER_ROOT
        value: {{ include "lorafleet.sharedAdapterRoot" $ | quote }}
      {{- end }}
      - name: LORAFLEET_TRAINER_CONTROLLER_ADDRESS
        value: {{ include "lorafleet.controllerAddress" $ | quote }}
      - name: LORAFLEET_TRAINER_ADVERTISE_ADDRESS
        {{- if eq .role "single" }}
        value: {{ include "lorafleet.advertiseAddress" (dict "ctx" $ "component" "trainer" "prefix" "LORAFLEET_TRAINER_" "port" $v.port) | quote }}
        {{- else }}
        # The leader's DNS name under the group's headless Service (created by LWS).
        value: {{ printf "$(LORAFLEET_TRAINER_REPLICA_ID).%s-group.%s.svc:%d" (include "lorafleet.componentName" $c) $.Release.Namespace (int $v.port) | quote }}
        {{- end }}
      - name: LORAFLEET_TRAINER_DEVICE
        value: {{ ternary "cuda" "cpu" (gt (int $gpu.count) 0) | quote }}
      {{- if or (gt $gpus 1) (ne .role "single") }}
      - name: LORAFLEET_TRAINER_GROUP_TIMEOUT_SECONDS
        value: {{ $v.groupTimeoutSeconds | quote }}
      {{- end }}
      {{- with $v.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if $serves }}
    {{- include "lorafleet.grpcProbes" (dict "ctx" $ "v" $v "service" "lorafleet.v1.TrainerService") | nindent 4 }}
    {{- end }}
    resources:
      {{- include "lorafleet.gpuResources" (dict "ctx" $ "resources" $v.resources "gpu" $gpu) | nindent 6 }}
    securityContext:
      {{- include "lorafleet.containerSecurityContext" $ | nindent 6 }}
    volumeMounts:
      {{- include "lorafleet.workerMounts" (dict "ctx" $ "v" $v) | nindent 6 }}
      {{- with include "lorafleet.tlsMount" $ }}{{ . | nindent 6 }}{{ end }}
      {{- with $v.extraVolumeMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
volumes:
  {{- include "lorafleet.workerVolumes" (dict "ctx" $ "v" $v) | nindent 2 }}
  {{- with include "lorafleet.tlsVolume" $c }}{{ . | nindent 2 }}{{ end }}
{{- end -}}

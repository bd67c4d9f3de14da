{{/* Names, labels and shared pod pieces. Components pass (dict "ctx" $ "component" "trainer"). */}}

{{- define "lorafleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "lorafleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<component>, kept short enough for StatefulSet pod names and DNS labels. */}}
{{- define "lorafleet.componentName" -}}
{{- printf "%s-%s" (include "lorafleet.fullname" .ctx | trunc 40 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "lorafleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lorafleet.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "lorafleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{ include "lorafleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: lorafleet
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A lorafleet service image: registry/repository:tag, tag defaulting to appVersion. */}}
{{- define "lorafleet.image" -}}
{{- $v := .ctx.Values -}}
{{- $img := index $v .component "image" -}}
{{- $tag := default (default .ctx.Chart.AppVersion $v.image.tag) $img.tag -}}
{{- if $v.image.registry -}}
{{- printf "%s/%s:%s" $v.image.registry $img.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" $img.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* A third-party image from {registry, repository, tag}. */}}
{{- define "lorafleet.thirdPartyImage" -}}
{{- if .registry -}}
{{- printf "%s/%s:%s" .registry .repository .tag -}}
{{- else -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}
{{- end -}}

{{/* Container resources with `count` GPUs of the configured resource name added to limits. */}}
{{- define "lorafleet.gpuResources" -}}
{{- $res := deepCopy (default (dict) .resources) -}}
{{- $count := int .gpu.count -}}
{{- if gt $count 0 -}}
{{- $name := default .ctx.Values.gpu.resourceName .gpu.resourceName -}}
{{- $limits := default (dict) $res.limits -}}
{{- $_ := set $limits $name $count -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/*
Native gRPC probes: liveness asks service "" (the process), readiness the named service. With
tls.enabled they ask the plaintext health port (v.healthPort): the kubelet cannot present a
client certificate, and that port serves grpc.health.v1 alone, from the same health state.
*/}}
{{- define "lorafleet.grpcProbes" -}}
{{- $port := ternary .v.healthPort .v.port .ctx.Values.tls.enabled -}}
startupProbe:
  grpc: {port: {{ $port }}, service: ""}
  {{- toYaml .v.probes.startup | nindent 2 }}
livenessProbe:
  grpc: {port: {{ $port }}, service: ""}
  {{- toYaml .v.probes.liveness | nindent 2 }}
readinessProbe:
  grpc: {port: {{ $port }}, service: {{ .service | quote }}}
  {{- toYaml .v.probes.readiness | nindent 2 }}
{{- end -}}

{{/* The health container port (tls.enabled only); pass ctx and v. */}}
{{- define "lorafleet.healthContainerPort" -}}
{{- if .ctx.Values.tls.enabled -}}
- {name: health, containerPort: {{ .v.healthPort }}, protocol: TCP}
{{- end }}
{{- end -}}

{{/* The name every service certificate carries and every peer is checked against. */}}
{{- define "lorafleet.tlsServerName" -}}
{{- default (printf "%s-internal" (include "lorafleet.fullname" .)) .Values.tls.serverName -}}
{{- end -}}

{{/* The Secret holding a component's certificate (ca.crt, tls.crt, tls.key); "admin" too. */}}
{{- define "lorafleet.tlsSecretName" -}}
{{- $existing := index .ctx.Values.tls.existingSecret .component | default "" -}}
{{- default (printf "%s-tls" (include "lorafleet.componentName" .)) $existing -}}
{{- end -}}

{{/* LORAFLEET_TLS_* of a lorafleet container (tls.enabled only). */}}
{{- define "lorafleet.tlsEnv" -}}
{{- $t := .Values.tls -}}
{{- if $t.enabled -}}
- name: LORAFLEET_TLS_CA_FILE
  value: {{ printf "%s/ca.crt" $t.mountPath | quote }}
- name: LORAFLEET_TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" $t.mountPath | quote }}
- name: LORAFLEET_TLS_KEY_FILE
  value: {{ printf "%s/tls.key" $t.mountPath | quote }}
- name: LORAFLEET_TLS_SERVER_NAME
  value: {{ include "lorafleet.tlsServerName" . | quote }}
- name: LORAFLEET_TLS_ADMIN_NAMES
  value: {{ join "," $t.adminNames | quote }}
{{- end }}
{{- end -}}

{{/* The certificate's read-only mount (tls.enabled only). */}}
{{- define "lorafleet.tlsMount" -}}
{{- if .Values.tls.enabled -}}
- {name: tls, mountPath: {{ .Values.tls.mountPath }}, readOnly: true}
{{- end }}
{{- end -}}

{{/* The certificate volume of a component's pod (tls.enabled only); pass ctx and component. */}}
{{- define "lorafleet.tlsVolume" -}}
{{- if .ctx.Values.tls.enabled -}}
- name: tls
  secret:
    secretName: {{ include "lorafleet.tlsSecretName" . }}
    # 0440: the key is readable by the pod's group (fsGroup) only.
    defaultMode: 288
{{- end }}
{{- end -}}

{{/* Workload annotations: stakater Reloader rolls the pods when the certificate changes. */}}
{{- define "lorafleet.workloadAnnotations" -}}
{{- $t := .ctx.Values.tls -}}
{{- if and $t.enabled $t.reloader -}}
annotations:
  secret.reloader.stakater.com/reload: {{ include "lorafleet.tlsSecretName" . | quote }}
{{- end }}
{{- end -}}

{{- define "lorafleet.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{- define "lorafleet.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext -}}
{{- end -}}

{{/* Scheduling keys shared by every pod spec: pass the component's values map as .v. */}}
{{- define "lorafleet.scheduling" -}}
{{- with .v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .v.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Env shared by the lorafleet services, each variable only where the service reads it:
<PREFIX>PORT, METRICS_PORT, LOG_LEVEL, HOST, GRACE_SECONDS, HEALTH_PORT (internal TLS on),
REPLICA_ID (the pod name), NAMESPACE (the controller's Services and Lease), the component's
`settings` map and the LORAFLEET_TLS_* identity. Pass ctx, prefix and the values map as v.
*/}}
{{- define "lorafleet.commonEnv" -}}
- name: {{ .prefix }}PORT
  value: {{ .v.port | quote }}
{{- if hasKey .v "metricsPort" }}
- name: {{ .prefix }}METRICS_PORT
  value: {{ .v.metricsPort | quote }}
{{- end }}
- name: {{ .prefix }}LOG_LEVEL
  value: {{ .v.logLevel | quote }}
- name: {{ .prefix }}HOST
  value: "0.0.0.0"
{{- if hasKey .v "graceSeconds" }}
- name: {{ .prefix }}GRACE_SECONDS
  value: {{ .v.graceSeconds | quote }}
{{- end }}
{{- if ne .prefix "LORAFLEET_GATEWAY_" }}
- name: {{ .prefix }}REPLICA_ID
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
{{- end }}
{{- if eq .prefix "LORAFLEET_CONTROLLER_" }}
- name: {{ .prefix }}NAMESPACE
  valueFrom:
    fieldRef: {fieldPath: metadata.namespace}
{{- end }}
{{- if and .ctx.Values.tls.enabled (hasKey .v "healthPort") }}
- name: {{ .prefix }}HEALTH_PORT
  value: {{ .v.healthPort | quote }}
{{- end }}
{{- include "lorafleet.settingsEnv" . }}
{{- with include "lorafleet.tlsEnv" .ctx }}
{{ . }}
{{- end }}
{{- end -}}

{{/*
A component's `settings` map as env: each key that is not null becomes
<PREFIX><KEY in UPPER_SNAKE> (sessionTimeoutSeconds -> SESSION_TIMEOUT_SECONDS). Whole numbers
print as integers (values arrive as float64: 268435456 must not become 2.68435456e+08).
*/}}
{{- define "lorafleet.settingsEnv" -}}
{{- range $key, $value := .v.settings }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ printf "%s%s" $.prefix ($key | snakecase | upper) }}
  {{- if and (kindIs "float64" $value) (eq (floor $value) $value) }}
  value: {{ int64 $value | quote }}
  {{- else }}
  value: {{ toString $value | quote }}
  {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "lorafleet.controllerAddress" -}}
{{- printf "%s:%d" (include "lorafleet.componentName" (dict "ctx" . "component" "controller")) (int .Values.controller.port) -}}
{{- end -}}

{{/* Static replica list "pod=pod.headless.ns.svc:port,..." of a StatefulSet. */}}
{{- define "lorafleet.podAddresses" -}}
{{- $name := include "lorafleet.componentName" (dict "ctx" .ctx "component" .component) -}}
{{- $v := index .ctx.Values .component -}}
{{- $out := list -}}
{{- range $i := until (int $v.replicaCount) -}}
{{- $out = append $out (printf "%s-%d=%s-%d.%s-headless.%s.svc:%d" $name $i $name $i $name $.ctx.Release.Namespace (int $v.port)) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* The Redis URL as an EnvVar body (value or secretKeyRef); the bundled Redis's carries
$(REDIS_PASSWORD), which lorafleet.redisPasswordEnv sets just before it. */}}
{{- define "lorafleet.redisUrlEnv" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.external.cluster -}}
{{- fail "redis.external.cluster needs an external Redis Cluster: the bundled Redis is one node" -}}
{{- end -}}
value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%d/0" (include "lorafleet.componentName" (dict "ctx" . "component" "redis")) (int .Values.redis.port) | quote }}
{{- else if .Values.redis.external.existingSecret -}}
valueFrom:
  secretKeyRef: {name: {{ .Values.redis.external.existingSecret }}, key: {{ .Values.redis.external.secretKey }}}
{{- else if .Values.redis.external.url -}}
value: {{ .Values.redis.external.url | quote }}
{{- else -}}
{{- fail "redis.enabled=false needs redis.external.url or redis.external.existingSecret" -}}
{{- end -}}
{{- end -}}

{{/* Model volume (read-only) for trainer and rollout pods. */}}
{{- define "lorafleet.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "lorafleet.checkpointClaimName" -}}
{{- default (printf "%s-checkpoints" (include "lorafleet.fullname" .)) .Values.checkpoints.existingClaim -}}
{{- end -}}

{{/* The one folder of the checkpoint volume a rollout writes: the adapters pushed to it
(the service adds its replica id), which its SGLang or vLLM server reads by path. */}}
{{- define "lorafleet.rolloutAdapterDir" -}}
{{- printf "%s/rollout-adapters" (trimSuffix "/" .Values.checkpoints.mountPath) -}}
{{- end -}}

{{/* Where published adapters travel by reference when every pod mounts one claim
(checkpoints.mode shared): the trainer writes, the controller and rollouts read. */}}
{{- define "lorafleet.sharedAdapterRoot" -}}
{{- printf "%s/shared-adapters" (trimSuffix "/" .Values.checkpoints.mountPath) -}}
{{- end -}}

{{/* Volumes every GPU pod has: model, checkpoints (shared mode), /tmp, /dev/shm. */}}
{{- define "lorafleet.workerVolumes" -}}
{{ include "lorafleet.modelVolume" .ctx }}
{{- if eq .ctx.Values.checkpoints.mode "shared" }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "lorafleet.checkpointClaimName" .ctx }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- if .v.shm.enabled }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .v.shm.sizeLimit }}
{{- end }}
{{- with .v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "lorafleet.workerMounts" -}}
- name: model
  mountPath: {{ .ctx.Values.model.mountPath }}
  readOnly: true
- name: checkpoints
  mountPath: {{ .ctx.Values.checkpoints.mountPath }}
  {{- if .checkpointsReadOnly }}
  readOnly: true
  {{- end }}
- name: tmp
  mountPath: /tmp
{{- if .v.shm.enabled }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- end -}}

{{/* Per-pod checkpoint claims (checkpoints.mode: perPod). */}}
{{- define "lorafleet.checkpointClaimTemplates" -}}
{{- if eq .Values.checkpoints.mode "perPod" }}
volumeClaimTemplates:
  - metadata:
      name: checkpoints
    spec:
      accessModes: {{ toYaml .Values.checkpoints.accessModes | nindent 8 }}
      {{- with .Values.checkpoints.storageClassName }}
      storageClassName: {{ . }}
      {{- end }}
      resources:
        requests:
          storage: {{ .Values.checkpoints.size }}
{{- end }}
{{- end -}}

{{/* host:port the controller dials for this pod: its stable DNS name under the headless Service. */}}
{{- define "lorafleet.advertiseAddress" -}}
{{- $name := include "lorafleet.componentName" (dict "ctx" .ctx "component" .component) -}}
{{- printf "$(%sREPLICA_ID).%s-headless.%s.svc:%d" .prefix $name .ctx.Release.Namespace (int .port) -}}
{{- end -}}

{{- define "lorafleet.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.subPath | trimSuffix "/" -}}
{{- end -}}

{{- define "lorafleet.controllerServiceAccount" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "lorafleet.componentName" (dict "ctx" . "component" "controller")) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* A PodDisruptionBudget for one component. */}}
{{- define "lorafleet.pdb" -}}
{{- $v := index .ctx.Values .component -}}
{{- if $v.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "lorafleet.componentName" . }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "lorafleet.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ $v.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "lorafleet.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

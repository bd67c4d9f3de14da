{{/* The Secret holding the bundled Redis's password, and its key. */}}
{{- define "lorafleet.redisSecretName" -}}
{{- default (include "lorafleet.componentName" (dict "ctx" . "component" "redis")) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* REDIS_PASSWORD from that Secret, as an env list item (bundled Redis only): the Redis
container's requirepass and the controller's URL expand $(REDIS_PASSWORD), so the password
is in no manifest. */}}
{{- define "lorafleet.redisPasswordEnv" -}}
{{- if .Values.redis.enabled -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "lorafleet.redisSecretName" . }}, key: {{ .Values.redis.auth.secretKey }}}
{{- end -}}
{{- end -}}

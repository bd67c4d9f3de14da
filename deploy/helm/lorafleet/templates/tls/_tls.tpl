{{/* Who issues the certificates tls.existingSecret leaves out: "certManager" or "helm"
(tls.provider "auto": cert-manager when its API is installed in the cluster or an issuerRef
is named). */}}
{{- define "lorafleet.tlsProvider" -}}
{{- $p := .Values.tls.provider -}}
{{- if eq $p "auto" -}}
{{- $cm := or (.Capabilities.APIVersions.Has "cert-manager.io/v1") .Values.tls.certManager.issuerRef.name -}}
{{- $p = ternary "certManager" "helm" (not (empty $cm)) -}}
{{- end -}}
{{- $p -}}
{{- end -}}

{{/* The service kinds with no tls.existingSecret, as a JSON list. */}}
{{- define "lorafleet.tlsMissing" -}}
{{- $missing := list -}}
{{- range $kind := list "controller" "trainer" "rollout" "gateway" -}}
{{- if not (index $.Values.tls.existingSecret $kind) }}{{ $missing = append $missing $kind }}{{ end -}}
{{- end -}}
{{- toJson $missing -}}
{{- end -}}

{{/* DNS names of a kind's certificate, as a JSON list: the shared name peers check, the
kind's Services, and its pods' names under a headless one. Pass ctx and kind. */}}
{{- define "lorafleet.tlsDnsNames" -}}
{{- $ns := .ctx.Release.Namespace -}}
{{- $svc := include "lorafleet.componentName" (dict "ctx" .ctx "component" .kind) -}}
{{- $list := list (include "lorafleet.tlsServerName" .ctx) -}}
{{- if ne .kind "trainer" -}}
{{- $list = concat $list (list $svc (printf "%s.%s.svc" $svc $ns)) -}}
{{- end -}}
{{- if or (eq .kind "trainer") (eq .kind "rollout") -}}
{{- $headless := ternary (printf "%s-group" $svc) (printf "%s-headless" $svc) (index .ctx.Values .kind).leaderWorkerSet.enabled -}}
{{- $list = concat $list (list $headless (printf "*.%s.%s.svc" $headless $ns)) -}}
{{- end -}}
{{- toJson $list -}}
{{- end -}}

{{/* Names and labels shared by every resource of the chart. */}}

{{- define "llm-bulkhead.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "llm-bulkhead.fullname" -}}
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

{{- define "llm-bulkhead.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llm-bulkhead.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "llm-bulkhead.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "llm-bulkhead.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: llm-bulkhead
{{- end -}}

{{- define "llm-bulkhead.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "llm-bulkhead.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "llm-bulkhead.adminSecretName" -}}
{{- default (printf "%s-admin" (include "llm-bulkhead.fullname" .)) .Values.adminToken.existingSecret -}}
{{- end -}}

{{- define "llm-bulkhead.policyConfigMapName" -}}
{{- default (printf "%s-policy" (include "llm-bulkhead.fullname" .)) .Values.policy.existingConfigMap -}}
{{- end -}}

{{- define "llm-bulkhead.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "llm-bulkhead.fullname" .)) .Values.tls.secretName -}}
{{- end -}}

{{/* Environment variable that carries the Redis password (the policy's cluster.password_env). */}}
{{- define "llm-bulkhead.redisPasswordEnv" -}}LLM_BULKHEAD_REDIS_PASSWORD{{- end -}}

{{/*
The cluster section rendered into the policy from the cluster.* values: the policy's own
keys (docs/policy.md, "cluster"). Empty when cluster mode is off.
*/}}
{{- define "llm-bulkhead.clusterSection" -}}
{{- $c := .Values.cluster -}}
{{- if $c.enabled -}}
{{- if not $c.addresses -}}
{{- fail "cluster.enabled needs cluster.addresses: the Redis host:port pairs" -}}
{{- end -}}
cluster:
  backend: redis
  addresses:
{{- range $c.addresses }}
    - {{ . | quote }}
{{- end }}
  mode: {{ $c.mode | quote }}
{{- if $c.masterName }}
  master_name: {{ $c.masterName | quote }}
{{- end }}
{{- if $c.username }}
  username: {{ $c.username | quote }}
{{- end }}
{{- if $c.passwordSecret.name }}
  password_env: {{ include "llm-bulkhead.redisPasswordEnv" . }}
{{- end }}
  key_prefix: {{ $c.keyPrefix | quote }}
  on_unavailable: {{ $c.onUnavailable | quote }}
  lease_ttl: {{ $c.leaseTTL | quote }}
  timeout: {{ $c.timeout | quote }}
{{- if $c.tls.enabled }}
  tls:
    enabled: true
{{- if $c.tls.secretName }}
    ca_file: /etc/llm-bulkhead/redis-tls/ca.crt
{{- if $c.tls.mutual }}
    cert_file: /etc/llm-bulkhead/redis-tls/tls.crt
    key_file: /etc/llm-bulkhead/redis-tls/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- end -}}
{{- end -}}

{{/*
The policy file the ConfigMap holds: policy.content, else the shipped examples/policy.yaml,
with the cluster section appended when cluster mode is on.
*/}}
{{- define "llm-bulkhead.policy" -}}
{{- $policy := .Values.policy.content | default (.Files.Get "files/policy.yaml") -}}
{{- if not $policy -}}
{{- fail "the policy is empty: set policy.content, or keep files/policy.yaml in the chart" -}}
{{- end -}}
{{- $cluster := include "llm-bulkhead.clusterSection" . -}}
{{- if $cluster -}}
{{- if hasKey (fromYaml $policy) "cluster" -}}
{{- fail "policy.content already has a cluster section: set cluster.enabled=false and keep it there, or remove it from the policy" -}}
{{- end -}}
{{- printf "%s\n\n# Rendered by the chart from the cluster.* values.\n%s\n" (trimSuffix "\n" $policy) $cluster -}}
{{- else -}}
{{- $policy -}}
{{- end -}}
{{- end -}}

{{/* Several replicas without cluster mode: each enforces every limit on its own. */}}
{{- define "llm-bulkhead.perReplicaLimits" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.cluster.enabled) -}}true{{- end -}}
{{- end -}}

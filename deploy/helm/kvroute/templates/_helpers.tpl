{{/* Names and labels. */}}
{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Component names: worker pods are <fullname>-worker-<i>, so the prefix stays well under 63 characters. */}}
{{- define "kvroute.gateway.fullname" -}}{{ include "kvroute.fullname" . | trunc 52 | trimSuffix "-" }}-gateway{{- end }}
{{- define "kvroute.worker.fullname" -}}{{ include "kvroute.fullname" . | trunc 45 | trimSuffix "-" }}-worker{{- end }}
{{- define "kvroute.redis.fullname" -}}{{ include "kvroute.fullname" . | trunc 54 | trimSuffix "-" }}-redis{{- end }}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway"). */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvroute.componentLabels" -}}
{{ include "kvroute.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference: (dict "image" .Values.gateway.image "root" $); the tag defaults to appVersion, and a digest
pins it (repository:tag@sha256:...: the runtime pulls by the digest, the tag stays as a label for people). */}}
{{- define "kvroute.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag | toString) }}
{{- with .image.digest }}@{{ . }}{{ end }}
{{- end }}

{{- define "kvroute.workerImage" -}}
{{- if .Values.worker.gpu.enabled }}{{ include "kvroute.image" (dict "image" .Values.worker.image "root" .) }}
{{- else }}{{ include "kvroute.image" (dict "image" .Values.worker.cpuImage "root" .) }}{{ end }}
{{- end }}

{{- define "kvroute.workerImagePullPolicy" -}}
{{- if .Values.worker.gpu.enabled }}{{ .Values.worker.image.pullPolicy }}{{ else }}{{ .Values.worker.cpuImage.pullPolicy }}{{ end }}
{{- end }}

{{- define "kvroute.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . | quote }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Values arrive as JSON numbers (float64): render integers without an exponent. */}}
{{- define "kvroute.int" -}}{{ int64 . | toString }}{{- end }}

{{/* The model spec both the gateways and the workers load. */}}
{{- define "kvroute.modelSpec" -}}
{{- if eq .Values.model.source "image" }}{{ .Values.model.name }}
{{- else }}{{ printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.name) }}{{ end }}
{{- end }}

{{- define "kvroute.modelClaimName" -}}
{{- default (printf "%s-model" (include "kvroute.fullname" .)) .Values.model.pvc.existingClaim }}
{{- end }}

{{/* The model volume (none when the model is baked into the images). */}}
{{- define "kvroute.modelVolume" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ include "kvroute.modelClaimName" . }}
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- end }}
{{- end }}

{{- define "kvroute.modelVolumeMount" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Secrets reach containers as files, never as environment variables or arguments. One secret file is
(dict "volume" NAME "secret" SECRET "key" KEY): the volume NAME holds only KEY, mounted at /etc/kvroute/NAME. */}}
{{- define "kvroute.secretFile.path" -}}/etc/kvroute/{{ .volume }}/{{ .key }}{{- end }}

{{- define "kvroute.secretFile.volume" -}}
- name: {{ .volume }}
  secret:
    secretName: {{ .secret }}
    defaultMode: 0440
    items:
      - key: {{ .key }}
        path: {{ .key }}
{{- end }}

{{- define "kvroute.secretFile.mount" -}}
- name: {{ .volume }}
  mountPath: /etc/kvroute/{{ .volume }}
  readOnly: true
{{- end }}

{{/* The worker token (auth.workerToken): gateways present it, workers require it. */}}
{{- define "kvroute.workerToken.secretName" -}}
{{ default (printf "%s-token" (include "kvroute.worker.fullname" .)) .Values.auth.workerToken.existingSecret }}
{{- end }}

{{- define "kvroute.workerToken.secretFile" -}}
{{ toYaml (dict "volume" "worker-token" "secret" (include "kvroute.workerToken.secretName" .) "key" .Values.auth.workerToken.secretKey) }}
{{- end }}

{{- define "kvroute.workerToken.env" -}}
- name: KVROUTE_WORKER_TOKEN_FILE
  value: {{ include "kvroute.secretFile.path" (include "kvroute.workerToken.secretFile" . | fromYaml) }}
{{- end }}

{{/* Redis: where the password lives, and the one URL every gateway and worker is given. */}}
{{- define "kvroute.redis.secretName" -}}
{{- if eq .Values.redis.mode "bundled" }}{{ default (include "kvroute.redis.fullname" .) .Values.redis.bundled.existingSecret }}
{{- else }}{{ .Values.redis.external.existingSecret }}{{ end }}
{{- end }}

{{- define "kvroute.gateway.cacheSaltSecretName" -}}
{{ default (printf "%s-cache-salt" (include "kvroute.gateway.fullname" .)) .Values.auth.cacheSaltSecret.existingSecret }}
{{- end }}

{{- define "kvroute.redis.secretKey" -}}
{{- if eq .Values.redis.mode "bundled" }}{{ .Values.redis.bundled.existingSecretKey }}{{ else }}{{ .Values.redis.external.existingSecretKey }}{{ end }}
{{- end }}

{{- define "kvroute.redis.hasPassword" -}}
{{- if or (eq .Values.redis.mode "bundled") .Values.redis.external.existingSecret }}true{{ end }}
{{- end }}

{{/* The URL carries no password (it would be on the command line): KVROUTE_REDIS_PASSWORD_FILE names it. */}}
{{- define "kvroute.redis.url" -}}
{{- if eq .Values.redis.mode "bundled" -}}
redis://{{ include "kvroute.redis.fullname" . }}.{{ .Release.Namespace }}.svc:{{ include "kvroute.int" .Values.redis.bundled.port }}/0
{{- else -}}
{{- $ext := .Values.redis.external }}
{{- $parts := regexFindAll "^[a-z+]+://|.*$" $ext.url 2 }}
{{- $userinfo := "" }}
{{- if $ext.username }}{{ $userinfo = printf "%s@" $ext.username }}{{ end }}
{{- $url := printf "%s%s%s" (index $parts 0) $userinfo (index $parts 1) }}
{{- if $ext.tls.caSecret }}
{{- $url = printf "%s%sssl_ca_certs=/etc/kvroute/redis-tls/%s" $url (ternary "&" "?" (contains "?" $url)) $ext.tls.caSecretKey }}
{{- end }}
{{- $url }}
{{- end }}
{{- end }}

{{- define "kvroute.redis.secretFile" -}}
{{ toYaml (dict "volume" "redis-auth" "secret" (include "kvroute.redis.secretName" .) "key" (include "kvroute.redis.secretKey" .)) }}
{{- end }}

{{- define "kvroute.redis.env" -}}
{{- if include "kvroute.redis.hasPassword" . }}
- name: KVROUTE_REDIS_PASSWORD_FILE
  value: {{ include "kvroute.secretFile.path" (include "kvroute.redis.secretFile" . | fromYaml) }}
{{- end }}
{{- end }}

{{- define "kvroute.redis.authVolume" -}}
{{- if include "kvroute.redis.hasPassword" . }}
{{- include "kvroute.secretFile.volume" (include "kvroute.redis.secretFile" . | fromYaml) }}
{{- end }}
{{- end }}

{{- define "kvroute.redis.authVolumeMount" -}}
{{- if include "kvroute.redis.hasPassword" . }}
{{- include "kvroute.secretFile.mount" (include "kvroute.redis.secretFile" . | fromYaml) }}
{{- end }}
{{- end }}

{{- define "kvroute.redis.tlsVolume" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls.caSecret }}
- name: redis-tls
  secret:
    secretName: {{ .Values.redis.external.tls.caSecret }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "kvroute.redis.tlsVolumeMount" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls.caSecret }}
- name: redis-tls
  mountPath: /etc/kvroute/redis-tls
  readOnly: true
{{- end }}
{{- end }}

{{/* OpenTelemetry: (dict "root" $ "service" "kvroute-gateway"). */}}
{{- define "kvroute.otel.env" -}}
{{- $otel := .root.Values.observability.otel }}
- name: OTEL_SERVICE_NAME
  value: {{ .service }}
{{- if $otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ $otel.insecure | quote }}
{{- end }}
{{- $attrs := list (printf "k8s.pod.name=$(POD_NAME)") (printf "k8s.namespace.name=%s" .root.Release.Namespace) }}
{{- range $key, $value := $otel.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $key (toString $value)) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- end }}

{{- define "kvroute.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}

{{/* Prometheus scrape annotations: (dict "root" $ "port" 9090). */}}
{{- define "kvroute.scrapeAnnotations" -}}
{{- if .root.Values.observability.prometheus.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ include "kvroute.int" .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* Seconds a pod gets from deletion to SIGKILL: the preStop pause, the drain, and a margin. */}}
{{- define "kvroute.gateway.terminationGrace" -}}
{{- if kindIs "invalid" .Values.gateway.terminationGracePeriodSeconds }}
{{- add (int64 .Values.gateway.preStopSleepSeconds) (int64 .Values.gateway.drainTimeout) 10 }}
{{- else }}{{ include "kvroute.int" .Values.gateway.terminationGracePeriodSeconds }}{{ end }}
{{- end }}

{{- define "kvroute.worker.terminationGrace" -}}
{{- if kindIs "invalid" .Values.worker.terminationGracePeriodSeconds }}
{{- add (int64 .Values.worker.preStopSleepSeconds) (int64 .Values.worker.drainTimeout) 15 }}
{{- else }}{{ include "kvroute.int" .Values.worker.terminationGracePeriodSeconds }}{{ end }}
{{- end }}

{{/* The model name clients and the gateways send: model.servedModelName, else the model spec (as the gateway's). */}}
{{- define "kvroute.servedModelName" -}}
{{- default (include "kvroute.modelSpec" .) .Values.model.servedModelName }}
{{- end }}

{{/* worker.kind vllm | sglang: the gateways' one --workers spec, the engines' headless Service resolved by DNS
on an interval; `*` in the ZMQ endpoints stands for each pod's address (gateway/worker_spec.py); the worker token
as the engines' API key (auth.workerToken.engineApiKey), and each pod's data-parallel ranks. */}}
{{- define "kvroute.engineWorkers" -}}
{{- $e := index .Values.worker .Values.worker.kind }}
{{- printf "%s://%s.%s.svc:%s?events=tcp://*:%s&replay=tcp://*:%s&discover=dns" .Values.worker.kind (include "kvroute.worker.fullname" .) .Release.Namespace (include "kvroute.int" $e.port) (include "kvroute.int" $e.kvEventsPort) (include "kvroute.int" $e.replayPort) }}
{{- if .Values.auth.workerToken.engineApiKey }}&api_key_file={{ include "kvroute.secretFile.path" (include "kvroute.workerToken.secretFile" . | fromYaml) }}{{ end }}
{{- $dp := include "kvroute.engineDataParallel" . | int }}
{{- if gt $dp 1 }}&dp={{ $dp }}{{ end }}
{{- end }}

{{/* worker.kind vllm | sglang: the data-parallel ranks of one engine pod (vllm.dataParallelSize, sglang.dpSize). */}}
{{- define "kvroute.engineDataParallel" -}}
{{- $e := index .Values.worker .Values.worker.kind }}
{{- if eq .Values.worker.kind "vllm" }}{{ include "kvroute.int" (default 1 $e.dataParallelSize) }}{{ else }}{{ include "kvroute.int" (default 1 $e.dpSize) }}{{ end }}
{{- end }}

{{/* An engine pod's ZMQ port name for rank r: `kv-events`, `kv-events-1`, ... (rank 0 keeps the plain name). */}}
{{- define "kvroute.engineEventsPortName" -}}
{{- if eq (int .rank) 0 }}{{ .name }}{{ else }}{{ printf "%s-%d" .name (int .rank) }}{{ end }}
{{- end }}

{{/* The engine pods' ports the gateways and the pickers reach: HTTP and every rank's two ZMQ ports. */}}
{{- define "kvroute.enginePolicyPorts" -}}
- port: http
  protocol: TCP
{{- range $r := until (include "kvroute.engineDataParallel" . | int) }}
{{- range $name := list "kv-events" "kv-replay" }}
- port: {{ include "kvroute.engineEventsPortName" (dict "name" $name "rank" $r) }}
  protocol: TCP
{{- end }}
{{- end }}
{{- end }}

{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "sglang-d3d.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: <release>-<chart> unless the release already contains it. */}}
{{- define "sglang-d3d.fullname" -}}
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

{{- define "sglang-d3d.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sglang-d3d.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sglang-d3d.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "sglang-d3d.labels" -}}
helm.sh/chart: {{ include "sglang-d3d.chart" . }}
{{ include "sglang-d3d.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: server
{{- end }}

{{- define "sglang-d3d.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sglang-d3d.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sglang-d3d.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The target runs on the first GPU when there is one. */}}
{{- define "sglang-d3d.device" -}}
{{- if gt (int .Values.gpu.count) 0 }}cuda:0{{ else }}cpu{{ end }}
{{- end }}

{{- define "sglang-d3d.modelsClaim" -}}
{{- default (printf "%s-models" (include "sglang-d3d.fullname" .)) .Values.models.pvc.existingClaim }}
{{- end }}

{{/*
Connections kept free beyond the running and waiting requests: the readiness and liveness
probes (one each, the kubelet does not keep them alive) and up to two Prometheus scrapers.
*/}}
{{- define "sglang-d3d.spareConnections" -}}4{{- end }}

{{/*
Checks the schema cannot express: the drafter's device must be one of the GPUs requested,
the sglang backend needs a GPU (server/args.py: CUDA only) and cannot run fused mode (its verify
pass is SGLang's) or an int8 drafter (a CPU kernel), a closed /metrics needs an API key,
the connection cap must leave the probes room beside the running and waiting requests,
and the autoscaler's bounds must be ordered.
*/}}
{{- define "sglang-d3d.validate" -}}
{{- $gpus := int .Values.gpu.count }}
{{- $draft := .Values.server.draftDevice | default "" }}
{{- if hasPrefix "cuda" $draft }}
{{- $index := 0 }}
{{- if contains ":" $draft }}{{ $index = int (last (splitList ":" $draft)) }}{{ end }}
{{- if ge $index $gpus }}
{{- fail (printf "server.draftDevice=%s needs gpu.count > %d (it is %d)" $draft $index $gpus) }}
{{- end }}
{{- end }}
{{- if and (eq .Values.server.backend "sglang") (eq $gpus 0) }}
{{- fail "server.backend=sglang runs on CUDA: set gpu.count >= 1 (or use backend embedded on CPU)" }}
{{- end }}
{{- if and (eq .Values.server.backend "sglang") (eq .Values.server.mode "fused") }}
{{- fail "server.mode=fused runs in the embedded backend only: use async or sync with backend sglang" }}
{{- end }}
{{- if and (eq .Values.server.backend "sglang") (eq (.Values.server.draftWeights | default "") "int8") }}
{{- fail "server.draftWeights=int8 is for the embedded backend on CPU: SGLang's worker drafts on the GPU" }}
{{- end }}
{{- if and (eq .Values.server.backend "sglang") (gt (int (.Values.server.treeNodes | default 0)) 0) }}
{{- fail "server.treeNodes is for the embedded backend: SGLang's worker verifies chains" }}
{{- end }}
{{- if and (eq .Values.server.backend "sglang") (gt (int (.Values.server.lookupTokens | default 0)) 0) }}
{{- fail "server.lookupTokens is for the embedded backend: SGLang's worker verifies chains" }}
{{- end }}
{{- if and .Values.server.metricsNeedKey (not .Values.server.apiKeySecret.name) }}
{{- fail "server.metricsNeedKey needs server.apiKeySecret.name: a key to scrape /metrics with" }}
{{- end }}
{{- $held := add (int64 .Values.server.maxConcurrency) (int64 .Values.server.maxQueue) }}
{{- $needed := add $held (include "sglang-d3d.spareConnections" . | int64) }}
{{- if lt (int64 .Values.server.maxConnections) $needed }}
{{- fail (printf "server.maxConnections=%d leaves the probes no connection: every running and waiting request holds one (maxConcurrency + maxQueue = %d), and the readiness and liveness probes and the Prometheus scrapes need %s more; set it to at least %d" (int64 .Values.server.maxConnections) $held (include "sglang-d3d.spareConnections" .) $needed) }}
{{- end }}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" }}
{{- end }}
{{- end }}

{{/* `d3d serve` command line. Flags mirror the CLI one to one. */}}
{{- define "sglang-d3d.args" -}}
- serve
- --backend
- {{ .Values.server.backend | quote }}
- --mode
- {{ .Values.server.mode | quote }}
- --host
- "0.0.0.0"
- --port
- {{ .Values.server.port | quote }}
- --served-model-name
- {{ .Values.server.servedModelName | quote }}
- --max-concurrency
- {{ .Values.server.maxConcurrency | quote }}
- --max-queue
- {{ .Values.server.maxQueue | int64 | quote }}
- --device
- {{ include "sglang-d3d.device" . | quote }}
{{- with .Values.server.draftDevice }}
- --draft-device
- {{ . | quote }}
{{- end }}
{{- with .Values.server.dtype }}
- --dtype
- {{ . | quote }}
{{- end }}
{{- with .Values.server.draftWeights }}
- --draft-weights
- {{ . | quote }}
{{- end }}
{{- if not (kindIs "invalid" .Values.server.treeNodes) }}
- --tree-nodes
- {{ .Values.server.treeNodes | quote }}
{{- end }}
{{- if not (kindIs "invalid" .Values.server.lookupTokens) }}
- --lookup-tokens
- {{ .Values.server.lookupTokens | quote }}
{{- end }}
{{- if not (kindIs "invalid" .Values.server.spec.blockSize) }}
- --block-size
- {{ .Values.server.spec.blockSize | quote }}
{{- end }}
- --branch-policy
- {{ .Values.server.spec.branchPolicy | quote }}
- --branch-budget
- {{ .Values.server.spec.branchBudget | quote }}
- --guesses-per-position
- {{ .Values.server.spec.guessesPerPosition | quote }}
- --max-body-bytes
- {{ .Values.server.maxBodyBytes | int64 | quote }}
- --header-timeout
- {{ .Values.server.headerTimeout | quote }}
- --keep-alive-timeout
- {{ .Values.server.keepAliveTimeout | quote }}
- --max-connections
- {{ .Values.server.maxConnections | int64 | quote }}
{{- if .Values.server.metricsNeedKey }}
- --metrics-need-key
{{- end }}
{{- if ne .Values.models.source "builtin" }}
- --target
- {{ printf "%s/%s" (trimSuffix "/" .Values.models.mountPath) .Values.models.target | quote }}
{{- with .Values.models.drafter }}
- --drafter
- {{ printf "%s/%s" (trimSuffix "/" $.Values.models.mountPath) . | quote }}
{{- end }}
{{- end }}
{{- range .Values.server.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

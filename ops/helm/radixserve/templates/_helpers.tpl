{{/* Names, labels and the settings every radixserve container shares. */}}

{{- define "radixserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "radixserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/part-of: radixserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: include "radixserve.selector" (list . "gateway") */}}
{{- define "radixserve.selector" -}}
app.kubernetes.io/name: {{ index . 1 }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
{{- end -}}

{{- define "radixserve.natsUrl" -}}
{{- if .Values.nats.enabled -}}
nats://{{ include "radixserve.fullname" . }}-nats:4222
{{- else -}}
{{- required "nats.url is needed when nats.enabled is false" .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{- define "radixserve.natsSecret" -}}
{{- .Values.nats.existingSecret | default (printf "%s-nats" (include "radixserve.fullname" .)) -}}
{{- end -}}

{{- define "radixserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "radixserve.fullname" . }}-redis:6379/0
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/* The NATS login and namespace: RS_* variables, the password from its Secret (never inlined). */}}
{{- define "radixserve.natsEnv" -}}
- name: RS_NATS_URL
  value: {{ include "radixserve.natsUrl" . | quote }}
- name: RS_NATS_USER
  value: {{ .Values.nats.user | quote }}
- name: RS_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "radixserve.natsSecret" . }}
      key: password
- name: RS_NAMESPACE
  value: {{ .Values.namespace | quote }}
- name: RS_NATS_CONNECT_TIMEOUT
  value: "60"
- name: RS_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: RS_HOME
  value: /models
{{- end -}}

{{- define "radixserve.edgeImage" -}}
image: {{ printf "%s:%s" .Values.image.repository .Values.image.edgeTag | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- end -}}

{{- define "radixserve.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "radixserve.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/* A metrics-port probe (tokenizer, detokenizer, worker): the port answers once the service serves. */}}
{{- define "radixserve.metricsProbe" -}}
httpGet:
  path: /metrics
  port: metrics
{{- end -}}

{{- define "radixserve.serviceMonitor" -}}
{{- $mode := toString .Values.metrics.serviceMonitor.enabled -}}
{{- if or (eq $mode "true") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) -}}
true
{{- end -}}
{{- end -}}

{{/* RS_MODEL_PATH for a model under /models (pvc/hostPath with a path); the fetched default needs none. */}}
{{- define "radixserve.modelEnv" -}}
{{- if and (ne .Values.worker.model.source "fetch") .Values.worker.model.path }}
- name: RS_MODEL_PATH
  value: {{ printf "/models/%s" .Values.worker.model.path | quote }}
{{- end }}
{{- end -}}

{{/* The /models volume of a pod that reads the model (tokenizer, worker); `persistent` fetch volumes are
     the worker StatefulSet's claim template instead. */}}
{{- define "radixserve.modelVolume" -}}
{{- $model := .Values.worker.model -}}
- name: models
{{- if eq $model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "worker.model.existingClaim is needed with source pvc" $model.existingClaim }}
    readOnly: true
{{- else if eq $model.source "hostPath" }}
  hostPath:
    path: {{ required "worker.model.hostPath is needed with source hostPath" $model.hostPath }}
    type: Directory
{{- else if eq $model.source "fetch" }}
  emptyDir: {}
{{- else }}
{{- fail (printf "worker.model.source must be fetch, pvc or hostPath, not %q" $model.source) }}
{{- end }}
{{- end -}}

{{/* With source fetch: an init container writes the embedded default model into /models first. */}}
{{- define "radixserve.modelFetch" -}}
{{- if eq .Values.worker.model.source "fetch" }}
initContainers:
  - name: model-fetch
    image: {{ printf "%s:%s" .Values.image.repository .Values.image.workerTag | quote }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    args: ["model", "fetch"]
    env:
      - name: RS_HOME
        value: /models
    {{- include "radixserve.containerSecurity" . | nindent 4 }}
    volumeMounts:
      - {name: models, mountPath: /models}
{{- end }}
{{- end -}}

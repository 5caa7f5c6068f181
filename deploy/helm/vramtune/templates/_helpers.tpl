{{/* Names and labels shared by every object. */}}
{{- define "vramtune.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vramtune.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component (service, worker, migration). */}}
{{- define "vramtune.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "vramtune.databaseSecret" -}}
{{- .Values.database.existingSecret | default (printf "%s-database" (include "vramtune.fullname" .)) -}}
{{- end -}}

{{- define "vramtune.adminSecret" -}}
{{- .Values.tokens.adminExistingSecret | default (printf "%s-admin-token" (include "vramtune.fullname" .)) -}}
{{- end -}}

{{/* VRAMTUNE_DATABASE_URL from its Secret: the service and the migration Job both read it. */}}
{{- define "vramtune.databaseEnv" -}}
- name: VRAMTUNE_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "vramtune.databaseSecret" . }}
      key: url
{{- end -}}

{{- define "vramtune.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end -}}

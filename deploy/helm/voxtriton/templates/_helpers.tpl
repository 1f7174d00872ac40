{{- define "voxtriton.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "voxtriton.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: include "voxtriton.selector" (list . "triton") */}}
{{- define "voxtriton.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* the headless Service's DNS name: one address per ready server pod, for Envoy */}}
{{- define "voxtriton.tritonHeadless" -}}
{{- printf "%s-triton-headless.%s.svc.%s" (include "voxtriton.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* the checkpoint volume and its mount, as list items: only when one is configured */}}
{{- define "voxtriton.checkpointVolume" -}}
- name: checkpoint
{{- if .Values.checkpoint.persistentVolumeClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.checkpoint.persistentVolumeClaim }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ .Values.checkpoint.hostPath }}
    type: Directory
{{- end }}
{{- end -}}

{{- define "voxtriton.checkpointMount" -}}
- name: checkpoint
  mountPath: /models/checkpoint
  readOnly: true
{{- end -}}

{{/* the shared registered-voices volume and its mount, as list items: only when a claim is set */}}
{{- define "voxtriton.voicesVolume" -}}
- name: voices
  persistentVolumeClaim:
    claimName: {{ .Values.voices.persistentVolumeClaim }}
{{- end -}}

{{- define "voxtriton.voicesMount" -}}
- name: voices
  mountPath: /voices
{{- end -}}

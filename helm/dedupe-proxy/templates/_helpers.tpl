{{/* Chart name, overridable. */}}
{{- define "dedupe-proxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name, with the chart name unless it already holds it. */}}
{{- define "dedupe-proxy.fullname" -}}
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

{{/* The full name with a suffix, still a valid DNS label. */}}
{{- define "dedupe-proxy.suffixed" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "dedupe-proxy.fullname" $root | trunc (int (sub 62 (len (index . 1)))) | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "dedupe-proxy.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dedupe-proxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dedupe-proxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dedupe-proxy.labels" -}}
helm.sh/chart: {{ include "dedupe-proxy.chart" . }}
{{ include "dedupe-proxy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: {{ include "dedupe-proxy.name" . }}
{{- end -}}

{{- define "dedupe-proxy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dedupe-proxy.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "dedupe-proxy.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Where the proxy forwards: the application in the same pod, or a Service. */}}
{{- define "dedupe-proxy.upstreamUrl" -}}
{{- if eq .Values.mode "sidecar" -}}
{{- printf "http://127.0.0.1:%d" (int .Values.sidecar.appPort) -}}
{{- else -}}
{{- required "gateway.upstreamUrl is required in gateway mode" .Values.gateway.upstreamUrl -}}
{{- end -}}
{{- end -}}

{{/* "true" when the store is the embedded SQLite file (no PostgreSQL Secret). */}}
{{- define "dedupe-proxy.sqlite" -}}
{{- $url := (.Values.config.store | default dict).url | default "sqlite://dedupe.db" -}}
{{- if and (not .Values.storeUrlSecret.name) (hasPrefix "sqlite:" $url) -}}true{{- end -}}
{{- end -}}

{{/*
What the readiness probe asks: readinessPath when set, otherwise /healthz
(the process serves). A store outage is every replica's at once, and
readiness that followed it would take every pod out of the Service together.
*/}}
{{- define "dedupe-proxy.readinessPath" -}}
{{- .Values.readinessPath | default "/healthz" -}}
{{- end -}}

{{/*
"true" when the proxy starts serving only once /readyz has answered: a
gateway that rejects webhooks while the store is down, so a rollout with a
store it cannot reach stalls instead of replacing working pods. Not a
sidecar, whose pod must not leave the application's Service over the store,
nor on_unavailable: forward, which keeps webhooks flowing through an outage.
*/}}
{{- define "dedupe-proxy.startupGate" -}}
{{- $onUnavailable := (.Values.config.store | default dict).on_unavailable | default "reject" -}}
{{- if and (eq .Values.mode "gateway") (eq $onUnavailable "reject") -}}true{{- end -}}
{{- end -}}

{{/*
The configuration file: config from values, with the listeners and the
upstream set by the chart.
*/}}
{{- define "dedupe-proxy.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- $upstream := deepCopy ($config.upstream | default dict) -}}
{{- $_ := set $upstream "url" (include "dedupe-proxy.upstreamUrl" .) -}}
{{- $_ := set $config "upstream" $upstream -}}
{{- $host := .Values.listenAddress | default "0.0.0.0" -}}
{{- if contains ":" $host -}}{{- $host = printf "[%s]" $host -}}{{- end -}}
{{- $_ := set $config "listen" (printf "%s:%d" $host (int .Values.ports.webhook)) -}}
{{- $_ := set $config "admin_listen" (printf "%s:%d" $host (int .Values.ports.admin)) -}}
{{- toYaml $config -}}
{{- end -}}

{{/*
Whole seconds (rounded up) of a duration written as the proxy reads it
(humantime's units: ms, s, m, h, d and their longer names, e.g. 25s, 1m30s,
2sec): (list "field.name" value).
*/}}
{{- define "dedupe-proxy.seconds" -}}
{{- $field := index . 0 -}}
{{- $text := index . 1 | toString | nospace -}}
{{- $units := dict "ns" 1 "nsec" 1 "us" 1000 "usec" 1000 "µs" 1000 "ms" 1000000 "msec" 1000000 "s" 1000000000 "sec" 1000000000 "secs" 1000000000 "second" 1000000000 "seconds" 1000000000 "m" 60000000000 "min" 60000000000 "mins" 60000000000 "minute" 60000000000 "minutes" 60000000000 "h" 3600000000000 "hr" 3600000000000 "hrs" 3600000000000 "hour" 3600000000000 "hours" 3600000000000 "d" 86400000000000 "day" 86400000000000 "days" 86400000000000 "w" 604800000000000 "week" 604800000000000 "weeks" 604800000000000 -}}
{{- $ns := 0 -}}
{{- $valid := regexMatch "^([0-9]+[a-zµ]+)+$" $text -}}
{{- range regexFindAll "[0-9]+[a-zµ]+" $text -1 -}}
{{- $n := regexFind "^[0-9]+" . -}}
{{- $unit := trimPrefix $n . -}}
{{- if hasKey $units $unit -}}
{{- $ns = add $ns (mul (int64 $n) (get $units $unit)) -}}
{{- else -}}
{{- $valid = false -}}
{{- end -}}
{{- end -}}
{{- if not $valid -}}
{{- fail (printf "config.%s %q: write it with ms, s, m, h or d (e.g. 25s, 1m30s) so the chart can derive terminationGracePeriodSeconds" $field $text) -}}
{{- end -}}
{{- div (add $ns 999999999) 1000000000 -}}
{{- end -}}

{{- define "dedupe-proxy.preStopSleep" -}}
{{- if semverCompare ">=1.30-0" .Capabilities.KubeVersion.Version -}}
{{- int .Values.preStopSleepSeconds -}}
{{- else -}}0{{- end -}}
{{- end -}}

{{/*
preStop delay + shutdown_grace + store.timeout (the final writes of claims
still open take up to one) + margin, so SIGKILL never cuts the drain short.
*/}}
{{- define "dedupe-proxy.terminationGracePeriodSeconds" -}}
{{- $grace := include "dedupe-proxy.seconds" (list "shutdown_grace" (.Values.config.shutdown_grace | default "25s")) | int -}}
{{- $storeTimeout := include "dedupe-proxy.seconds" (list "store.timeout" ((.Values.config.store | default dict).timeout | default "2s")) | int -}}
{{- add (include "dedupe-proxy.preStopSleep" . | int) $grace $storeTimeout (int .Values.terminationGraceExtraSeconds) -}}
{{- end -}}

{{/* Checks across values that the schema cannot express. */}}
{{- define "dedupe-proxy.validate" -}}
{{- if and (include "dedupe-proxy.sqlite" .) (gt (int .Values.replicaCount) 1) -}}
{{- fail "replicaCount > 1 needs the PostgreSQL store (storeUrlSecret): each pod's SQLite file would only see its own deliveries" -}}
{{- end -}}
{{- if include "dedupe-proxy.sqlite" . -}}
{{- $path := trimPrefix "sqlite://" ((.Values.config.store | default dict).url | default "sqlite://dedupe.db") -}}
{{- if or (and (hasPrefix "/" $path) (not (hasPrefix "/data/" $path))) (contains ".." $path) -}}
{{- fail (printf "config.store.url: the SQLite file %q must be on the persistent volume, under /data (a relative path is, e.g. sqlite://dedupe.db): elsewhere the read-only root filesystem refuses it, and its keys would not outlive the pod" $path) -}}
{{- end -}}
{{- if contains "/" (trimPrefix "./" (trimPrefix "/data/" $path)) -}}
{{- fail (printf "config.store.url: the SQLite file %q must be directly in /data (e.g. sqlite:///data/dedupe.db): the proxy creates the file but not its directory, which a new volume does not have" $path) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.serviceMonitor.enabled .Values.networkPolicy.enabled (not .Values.networkPolicy.adminFrom) -}}
{{- fail "serviceMonitor.enabled with networkPolicy.enabled needs networkPolicy.adminFrom (where Prometheus scrapes from): the NetworkPolicy would close the admin port to it" -}}
{{- end -}}
{{- if and (include "dedupe-proxy.sqlite" .) (not .Values.persistence.enabled) -}}
{{- fail "the SQLite store needs persistence.enabled: on an emptyDir its keys are lost with the pod, and events processed before a restart or a rollout are forwarded again; or use PostgreSQL (storeUrlSecret)" -}}
{{- end -}}
{{- if eq .Values.mode "sidecar" -}}
{{- if not .Values.sidecar.containers -}}
{{- fail "sidecar mode needs the application's containers in sidecar.containers" -}}
{{- end -}}
{{- range .Values.sidecar.containers -}}
{{- if eq .name "dedupe-proxy" -}}
{{- fail "sidecar.containers: the name dedupe-proxy is taken by the proxy's container" -}}
{{- end -}}
{{- end -}}
{{- $appPort := int .Values.sidecar.appPort -}}
{{- if or (eq $appPort (int .Values.ports.webhook)) (eq $appPort (int .Values.ports.admin)) -}}
{{- fail "sidecar.appPort must differ from ports.webhook and ports.admin: the containers share the pod's network" -}}
{{- end -}}
{{- end -}}
{{- if eq (int .Values.ports.webhook) (int .Values.ports.admin) -}}
{{- fail "ports.webhook and ports.admin must differ" -}}
{{- end -}}
{{- with .Values.podDisruptionBudget -}}
{{- if and .enabled (kindIs "invalid" .minAvailable) (kindIs "invalid" .maxUnavailable) -}}
{{- fail "podDisruptionBudget: set maxUnavailable or minAvailable" -}}
{{- end -}}
{{- if and .enabled (not (kindIs "invalid" .minAvailable)) -}}
{{- $replicas := int $.Values.replicaCount -}}
{{- if and (kindIs "string" .minAvailable) (hasSuffix "%" .minAvailable) -}}
{{- /* Kubernetes rounds a percentage of pods up. */ -}}
{{- $kept := div (add (mul (trimSuffix "%" .minAvailable | int) $replicas) 99) 100 -}}
{{- if ge (int $kept) $replicas -}}
{{- fail (printf "podDisruptionBudget.minAvailable %s of %d replicas rounds up to all of them: no pod could ever be evicted and node drains would block" .minAvailable $replicas) -}}
{{- end -}}
{{- else if ge (int .minAvailable) $replicas -}}
{{- fail "podDisruptionBudget.minAvailable must be below replicaCount, or no pod could ever be evicted and node drains would block" -}}
{{- end -}}
{{- else if and .enabled (not (kindIs "invalid" .maxUnavailable)) -}}
{{- if eq (toString .maxUnavailable | trimSuffix "%" | int) 0 -}}
{{- fail "podDisruptionBudget.maxUnavailable must be above 0, or no pod could ever be evicted and node drains would block" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

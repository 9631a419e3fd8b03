package deploy

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	certmanagerv1 "github.com/cert-manager/cert-manager/pkg/apis/certmanager/v1"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v4/pkg/chart/v2/lint"
	"helm.sh/helm/v4/pkg/chart/v2/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

// valueSets are the configurations every test renders: the defaults and the ones an operator
// turns on in production.
var valueSets = map[string]map[string]any{
	"defaults": {},
	"everything": {
		"metrics": map[string]any{
			"serviceMonitor":   map[string]any{"enabled": true, "labels": map[string]any{"release": "kube-prometheus-stack"}},
			"prometheusRule":   map[string]any{"enabled": true},
			"grafanaDashboard": map[string]any{"enabled": true, "annotations": map[string]any{"grafana_folder": "LLM"}},
		},
		"networkPolicy": map[string]any{
			"enabled": true,
			"grpcFrom": []any{map[string]any{"namespaceSelector": map[string]any{
				"matchLabels": map[string]any{"kubernetes.io/metadata.name": "envoy-gateway-system"}}}},
			"adminFrom": []any{map[string]any{"namespaceSelector": map[string]any{
				"matchLabels": map[string]any{"kubernetes.io/metadata.name": "monitoring"}}}},
		},
		"adminToken": map[string]any{"existingSecret": "bulkhead-admin-token", "secretKey": "admin-token"},
		"logLevel":   "debug",
		"extraEnv":   []any{map[string]any{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel-collector.observability:4317"}},
		"extraVolumes": []any{map[string]any{"name": "spend",
			"persistentVolumeClaim": map[string]any{"claimName": "llm-bulkhead-spend"}}},
		"extraVolumeMounts": []any{map[string]any{"name": "spend", "mountPath": "/var/lib/llm-bulkhead"}},
	},
	"tls": {
		"tls": map[string]any{"enabled": true, "secretName": "bulkhead-ext-proc-tls"},
	},
	"mtls-cert-manager": {
		"tls": map[string]any{"enabled": true, "mutual": true, "certManager": map[string]any{
			"enabled": true, "issuerRef": map[string]any{"name": "mesh-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}}},
	},
	"redis": {
		"cluster": map[string]any{
			"enabled":        true,
			"addresses":      []any{"redis-master.redis.svc:6379"},
			"passwordSecret": map[string]any{"name": "redis", "key": "redis-password"},
			"onUnavailable":  "closed",
		},
	},
	"replicas-3-redis-sentinel": {
		"replicaCount": 3,
		"cluster": map[string]any{
			"enabled":    true,
			"mode":       "sentinel",
			"masterName": "mymaster",
			"addresses":  []any{"redis-sentinel-0.redis:26379", "redis-sentinel-1.redis:26379", "redis-sentinel-2.redis:26379"},
			"tls":        map[string]any{"enabled": true, "secretName": "redis-tls", "mutual": true},
		},
	},
	"replicas-3-no-redis": {"replicaCount": 3},
}

// decoded is a rendered release decoded into the API types.
type decoded struct {
	rendered
	deployment     appsv1.Deployment
	service        corev1.Service
	policy         corev1.ConfigMap
	secret         *corev1.Secret
	pdb            *policyv1.PodDisruptionBudget
	netpol         *networkingv1.NetworkPolicy
	serviceMonitor *monitoringv1.ServiceMonitor
	rule           *monitoringv1.PrometheusRule
	dashboard      *corev1.ConfigMap
	certificate    *certmanagerv1.Certificate
}

// decodeAll renders values and decodes every manifest strictly into its official Go type. A
// kind the test does not know fails: a new template must be validated too.
func decodeAll(t *testing.T, values map[string]any) decoded {
	t.Helper()
	d := decoded{rendered: render(t, values)}
	for _, m := range d.manifests {
		what := m.template + " " + m.gvk.Kind + "/" + m.name
		switch m.gvk.GroupVersion().String() + " " + m.gvk.Kind {
		case "apps/v1 Deployment":
			strict(t, what, m.doc, &d.deployment)
		case "v1 Service":
			strict(t, what, m.doc, &d.service)
		case "v1 ConfigMap":
			var cm corev1.ConfigMap
			strict(t, what, m.doc, &cm)
			if strings.HasSuffix(cm.Name, "-dashboard") {
				d.dashboard = &cm
			} else {
				d.policy = cm
			}
		case "v1 Secret":
			d.secret = new(corev1.Secret)
			strict(t, what, m.doc, d.secret)
		case "v1 ServiceAccount":
			strict(t, what, m.doc, new(corev1.ServiceAccount))
		case "policy/v1 PodDisruptionBudget":
			d.pdb = new(policyv1.PodDisruptionBudget)
			strict(t, what, m.doc, d.pdb)
		case "networking.k8s.io/v1 NetworkPolicy":
			d.netpol = new(networkingv1.NetworkPolicy)
			strict(t, what, m.doc, d.netpol)
		case "monitoring.coreos.com/v1 ServiceMonitor":
			d.serviceMonitor = new(monitoringv1.ServiceMonitor)
			strict(t, what, m.doc, d.serviceMonitor)
		case "monitoring.coreos.com/v1 PrometheusRule":
			d.rule = new(monitoringv1.PrometheusRule)
			strict(t, what, m.doc, d.rule)
		case "cert-manager.io/v1 Certificate":
			d.certificate = new(certmanagerv1.Certificate)
			strict(t, what, m.doc, d.certificate)
		default:
			t.Fatalf("%s: no API type known for %s", what, m.gvk)
		}
	}
	if d.deployment.Name == "" || d.service.Name == "" {
		t.Fatalf("no Deployment or Service rendered: %v", d.kinds())
	}
	return d
}

func TestChartRendersValidObjects(t *testing.T) {
	for name, values := range valueSets {
		t.Run(name, func(t *testing.T) {
			d := decodeAll(t, values)
			checkDeployment(t, d, values)
			checkService(t, d)
			checkPolicy(t, d, values)
			checkPDB(t, d)
			checkMonitoring(t, d)
			checkNetworkPolicy(t, d)
			checkTLS(t, d, values)
		})
	}
}

func podContainer(t *testing.T, d decoded) corev1.Container {
	t.Helper()
	cs := d.deployment.Spec.Template.Spec.Containers
	if len(cs) != 1 {
		t.Fatalf("want one container, got %d", len(cs))
	}
	return cs[0]
}

// flag returns the value of --name=value in args, and whether it is there.
func flag(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func checkDeployment(t *testing.T, d decoded, values map[string]any) {
	t.Helper()
	dep := d.deployment
	want := int32(2)
	if n, ok := values["replicaCount"].(int); ok {
		want = int32(n)
	}
	if dep.Spec.Replicas == nil || *dep.Spec.Replicas != want {
		t.Errorf("replicas = %v, want %d", dep.Spec.Replicas, want)
	}
	sel, err := labelsSelector(dep.Spec.Selector.MatchLabels)
	if err != nil || !sel.Matches(labels.Set(dep.Spec.Template.Labels)) {
		t.Errorf("the Deployment's selector %v does not select its own pods %v", dep.Spec.Selector.MatchLabels, dep.Spec.Template.Labels)
	}
	if u := dep.Spec.Strategy.RollingUpdate; u == nil || u.MaxUnavailable == nil || u.MaxUnavailable.IntValue() != 0 {
		t.Errorf("a rolling update may take a replica down before its successor is ready: %+v", dep.Spec.Strategy)
	}

	pod := dep.Spec.Template.Spec
	c := podContainer(t, d)
	if c.Args[0] != "serve" {
		t.Errorf("args %q do not start with serve (the image's entrypoint is the binary)", c.Args)
	}

	// Security: non-root, read-only root, no capabilities, the runtime's seccomp profile.
	psc, sc := pod.SecurityContext, c.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.SeccompProfile == nil ||
		psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod security context %+v: want runAsNonRoot and seccomp RuntimeDefault", psc)
	}
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("container security context %+v: want a read-only root, no privilege escalation, every capability dropped", sc)
	}
	if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		t.Error("the pod mounts a service account token it never uses")
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %+v: want a CPU request and a memory limit", c.Resources)
	}

	// Probes on the admin port: /readyz (policy loaded, not draining), /healthz (alive).
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	for probe, path := range map[*corev1.Probe]string{c.ReadinessProbe: "/readyz", c.LivenessProbe: "/healthz"} {
		if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != path || probe.HTTPGet.Port.String() != "admin" {
			t.Errorf("want an HTTP probe of %s on the admin port, got %+v", path, probe)
		}
	}
	if admin, _ := flag(c.Args, "admin-addr"); admin != ":"+itoa(ports["admin"]) {
		t.Errorf("--admin-addr=%s does not listen on the admin container port %d", admin, ports["admin"])
	}
	if grpc, _ := flag(c.Args, "grpc-addr"); grpc != ":"+itoa(ports["grpc"]) {
		t.Errorf("--grpc-addr=%s does not listen on the grpc container port %d", grpc, ports["grpc"])
	}
	if int64(*pod.TerminationGracePeriodSeconds) <= 15 {
		t.Errorf("terminationGracePeriodSeconds %d leaves no room for the policy's drain_grace (15s)", *pod.TerminationGracePeriodSeconds)
	}

	// The admin token comes from a Secret: the chart's own, or the one named.
	var token *corev1.EnvVar
	for i, e := range c.Env {
		if e.Name == "LLM_BULKHEAD_ADMIN_TOKEN" {
			token = &c.Env[i]
		}
	}
	if token == nil || token.ValueFrom == nil || token.ValueFrom.SecretKeyRef == nil {
		t.Fatalf("LLM_BULKHEAD_ADMIN_TOKEN is not taken from a Secret: %+v", c.Env)
	}
	ref := token.ValueFrom.SecretKeyRef
	if d.secret != nil {
		v, ok := d.secret.Data[ref.Key]
		if d.secret.Name != ref.Name || !ok || len(v) < 32 {
			t.Errorf("the admin token refers to %s/%s, the chart's Secret is %s with keys %v (token %d bytes)",
				ref.Name, ref.Key, d.secret.Name, keys(d.secret.Data), len(v))
		}
	} else if ref.Name != "bulkhead-admin-token" || ref.Key != "admin-token" {
		t.Errorf("adminToken.existingSecret is not the Secret referred to: %+v", ref)
	}

	// The policy: the ConfigMap mounted as a directory (a subPath mount would never see the
	// ..data swap of an update), --config inside it, watched.
	config, _ := flag(c.Args, "config")
	var mount *corev1.VolumeMount
	for i, m := range c.VolumeMounts {
		if strings.HasPrefix(config, m.MountPath+"/") {
			mount = &c.VolumeMounts[i]
		}
	}
	if mount == nil {
		t.Fatalf("--config=%s is not inside a mounted volume: %+v", config, c.VolumeMounts)
	}
	if mount.SubPath != "" || !mount.ReadOnly {
		t.Errorf("policy mount %+v: want a read-only directory mount, no subPath", mount)
	}
	vol := volume(t, pod, mount.Name)
	if vol.ConfigMap == nil || vol.ConfigMap.Name != d.policy.Name {
		t.Errorf("volume %s is not the policy ConfigMap %s: %+v", mount.Name, d.policy.Name, vol)
	}
	if _, ok := d.policy.Data[strings.TrimPrefix(config, mount.MountPath+"/")]; !ok {
		t.Errorf("--config=%s names no key of ConfigMap %s (keys %v)", config, d.policy.Name, keys(d.policy.Data))
	}
	if w, _ := flag(c.Args, "watch"); w != "true" {
		t.Errorf("--watch=%q: the mounted policy is not reloaded", w)
	}
	for _, m := range anyList(values["extraVolumeMounts"]) {
		name := m.(map[string]any)["name"].(string)
		mounted := slices.ContainsFunc(c.VolumeMounts, func(vm corev1.VolumeMount) bool {
			return vm.Name == name && vm.MountPath == m.(map[string]any)["mountPath"]
		})
		if v := volume(t, pod, name); !mounted || v.PersistentVolumeClaim == nil {
			t.Errorf("extra volume %s is not mounted as given: %+v", name, c.VolumeMounts)
		}
	}
	if lvl, ok := values["logLevel"].(string); ok {
		if got, _ := flag(c.Args, "log-level"); got != lvl {
			t.Errorf("--log-level=%q, want %q", got, lvl)
		}
	}
}

func volume(t *testing.T, pod corev1.PodSpec, name string) corev1.Volume {
	t.Helper()
	for _, v := range pod.Volumes {
		if v.Name == name {
			return v
		}
	}
	t.Fatalf("no volume %q", name)
	return corev1.Volume{}
}

func checkService(t *testing.T, d decoded) {
	t.Helper()
	c := podContainer(t, d)
	sel, _ := labelsSelector(d.service.Spec.Selector)
	if !sel.Matches(labels.Set(d.deployment.Spec.Template.Labels)) {
		t.Errorf("the Service selects %v, not the pods %v", d.service.Spec.Selector, d.deployment.Spec.Template.Labels)
	}
	names := map[string]bool{}
	for _, p := range c.Ports {
		names[p.Name] = true
	}
	byName := map[string]corev1.ServicePort{}
	for _, p := range d.service.Spec.Ports {
		byName[p.Name] = p
		if !names[p.TargetPort.String()] {
			t.Errorf("service port %s targets %s, which the container does not have", p.Name, p.TargetPort.String())
		}
	}
	grpc, ok := byName["grpc"]
	if !ok {
		t.Fatal("the Service has no grpc port")
	}
	tls := len(podTLSArgs(c)) > 0
	switch {
	case !tls && (grpc.AppProtocol == nil || *grpc.AppProtocol != "kubernetes.io/h2c"):
		t.Errorf("the gRPC port without TLS must say kubernetes.io/h2c, so gateways speak HTTP/2 to it; got %v", grpc.AppProtocol)
	case tls && grpc.AppProtocol != nil:
		t.Errorf("the gRPC port with TLS says appProtocol %s, which would make gateways speak clear-text HTTP/2", *grpc.AppProtocol)
	}
}

func podTLSArgs(c corev1.Container) []string {
	var out []string
	for _, a := range c.Args {
		if strings.HasPrefix(a, "--tls-") {
			out = append(out, a)
		}
	}
	return out
}

func checkPolicy(t *testing.T, d decoded, values map[string]any) {
	t.Helper()
	c := podContainer(t, d)
	config, _ := flag(c.Args, "config")
	text := d.policy.Data[filepath.Base(config)]
	validatePolicy(t, text)
	p := policyCluster(t, text)
	cluster, _ := values["cluster"].(map[string]any)
	if cluster == nil {
		if text != string(readRepoFile(t, "examples/policy.yaml")) {
			t.Error("the default policy ConfigMap is not examples/policy.yaml")
		}
		if p.Cluster.Backend != "" {
			t.Errorf("cluster backend %q without cluster.enabled", p.Cluster.Backend)
		}
		return
	}
	// Cluster mode: the policy's cluster section from the values, the password from a Secret
	// through the variable the section names.
	if p.Cluster.Backend != "redis" || !slices.Equal(anyStrings(cluster["addresses"]), p.Cluster.Addresses) {
		t.Errorf("cluster section %+v does not match the values %v", p.Cluster, cluster)
	}
	if m, ok := cluster["mode"].(string); ok && p.Cluster.Mode != m {
		t.Errorf("cluster.mode %q, want %q", p.Cluster.Mode, m)
	}
	if ps, ok := cluster["passwordSecret"].(map[string]any); ok {
		var env *corev1.EnvVar
		for i, e := range c.Env {
			if e.Name == p.Cluster.PasswordEnv {
				env = &c.Env[i]
			}
		}
		if p.Cluster.PasswordEnv == "" || env == nil || env.ValueFrom == nil || env.ValueFrom.SecretKeyRef == nil ||
			env.ValueFrom.SecretKeyRef.Name != ps["name"] || env.ValueFrom.SecretKeyRef.Key != ps["key"] {
			t.Errorf("password_env %q is not set from Secret %v: %+v", p.Cluster.PasswordEnv, ps, c.Env)
		}
	} else if p.Cluster.PasswordEnv != "" {
		t.Errorf("password_env %q without a password Secret", p.Cluster.PasswordEnv)
	}
	if tls, ok := cluster["tls"].(map[string]any); ok {
		if tls["enabled"] == true && !p.Cluster.TLS.Enabled {
			t.Error("cluster.tls.enabled is not rendered into the policy")
		}
		// The Redis CA and client certificate files are in the Secret's mounted directory.
		secret, _ := tls["secretName"].(string)
		files := []string{p.Cluster.TLS.CAFile, p.Cluster.TLS.CertFile, p.Cluster.TLS.KeyFile}
		if secret != "" && (files[0] == "" || (tls["mutual"] == true) != (files[1] != "" && files[2] != "")) {
			t.Errorf("cluster.tls %v renders files %q", tls, files)
		}
		for _, f := range files {
			if f == "" {
				continue
			}
			found := false
			for _, m := range c.VolumeMounts {
				if filepath.Dir(f) == m.MountPath {
					v := volume(t, d.deployment.Spec.Template.Spec, m.Name)
					found = v.Secret != nil && v.Secret.SecretName == secret
				}
			}
			if !found {
				t.Errorf("%s is not in the mounted Secret %s", f, secret)
			}
		}
	}
	// The cluster section is read at start only: a change must roll the pods.
	def := decodeAll(t, nil)
	if d.deployment.Spec.Template.Annotations["checksum/cluster"] == def.deployment.Spec.Template.Annotations["checksum/cluster"] {
		t.Error("enabling cluster mode does not change the pod template: the running pods would keep their limits per replica")
	}
}

func anyList(v any) []any {
	l, _ := v.([]any)
	return l
}

func anyStrings(v any) []string {
	var out []string
	for _, s := range v.([]any) {
		out = append(out, s.(string))
	}
	return out
}

func checkPDB(t *testing.T, d decoded) {
	t.Helper()
	replicas := *d.deployment.Spec.Replicas
	if replicas < 2 {
		if d.pdb != nil {
			t.Error("a PodDisruptionBudget for one replica would block every node drain")
		}
		return
	}
	if d.pdb == nil {
		t.Fatal("no PodDisruptionBudget for several replicas")
	}
	sel, _ := labelsSelector(d.pdb.Spec.Selector.MatchLabels)
	if !sel.Matches(labels.Set(d.deployment.Spec.Template.Labels)) {
		t.Error("the PodDisruptionBudget does not select the pods")
	}
	if m := d.pdb.Spec.MinAvailable; m == nil || m.IntValue() < 1 || int32(m.IntValue()) >= replicas {
		t.Errorf("minAvailable %v: want at least 1 and fewer than the %d replicas", m, replicas)
	}
}

func checkMonitoring(t *testing.T, d decoded) {
	t.Helper()
	if sm := d.serviceMonitor; sm != nil {
		sel, _ := labelsSelector(sm.Spec.Selector.MatchLabels)
		if !sel.Matches(labels.Set(d.service.Labels)) {
			t.Errorf("the ServiceMonitor selects %v, not the Service's labels %v", sm.Spec.Selector.MatchLabels, d.service.Labels)
		}
		if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "admin" || sm.Spec.Endpoints[0].Path != "/metrics" {
			t.Errorf("ServiceMonitor endpoints %+v: want /metrics on the admin port", sm.Spec.Endpoints)
		}
	}
	if d.rule != nil {
		var shipped monitoringv1.PrometheusRuleSpec
		strict(t, "examples/alerts.yaml", readRepoFile(t, "examples/alerts.yaml"), &shipped)
		if len(shipped.Groups) == 0 || !reflect.DeepEqual(shipped, d.rule.Spec) {
			t.Error("the PrometheusRule's rules differ from examples/alerts.yaml")
		}
		promtoolRules(t, d.rule.Spec)
	}
	if cm := d.dashboard; cm != nil {
		if cm.Labels["grafana_dashboard"] != "1" {
			t.Errorf("the dashboard ConfigMap lacks the grafana_dashboard label: %v", cm.Labels)
		}
		if cm.Data["llm-bulkhead.json"] != string(readRepoFile(t, "examples/grafana-dashboard.json")) {
			t.Error("the dashboard ConfigMap is not examples/grafana-dashboard.json")
		}
	}
}

// promtoolRules checks the rendered rules with promtool and runs the shipped rule tests
// (examples/alerts_test.yaml) against them.
func promtoolRules(t *testing.T, spec monitoringv1.PrometheusRuleSpec) {
	t.Helper()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("LLM_BULKHEAD_REQUIRE_TOOLS") == "1" {
			t.Fatal("promtool is required (LLM_BULKHEAD_REQUIRE_TOOLS=1) but not installed")
		}
		t.Log("promtool not installed: the rendered rules are compared with examples/alerts.yaml only")
		return
	}
	dir := t.TempDir()
	rules, err := yaml.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "alerts.yaml"), rules, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "alerts_test.yaml"), readRepoFile(t, "examples/alerts_test.yaml"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"check", "rules", "alerts.yaml"}, {"test", "rules", "alerts_test.yaml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool %s on the PrometheusRule's rules: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

func checkNetworkPolicy(t *testing.T, d decoded) {
	t.Helper()
	np := d.netpol
	if np == nil {
		return
	}
	sel, _ := labelsSelector(np.Spec.PodSelector.MatchLabels)
	if !sel.Matches(labels.Set(d.deployment.Spec.Template.Labels)) {
		t.Error("the NetworkPolicy does not select the pods")
	}
	names := map[string]bool{}
	for _, p := range podContainer(t, d).Ports {
		names[p.Name] = true
	}
	for _, rule := range np.Spec.Ingress {
		if len(rule.From) == 0 {
			t.Errorf("ingress rule %+v admits anyone although peers were given", rule)
		}
		for _, p := range rule.Ports {
			if p.Port == nil || !names[p.Port.String()] {
				t.Errorf("ingress rule names port %v, which the container does not have", p.Port)
			}
		}
	}
}

func checkTLS(t *testing.T, d decoded, values map[string]any) {
	t.Helper()
	c := podContainer(t, d)
	args := podTLSArgs(c)
	tlsValues, _ := values["tls"].(map[string]any)
	if tlsValues == nil {
		if len(args) > 0 || d.certificate != nil {
			t.Errorf("TLS configured although tls.enabled is false: %v", args)
		}
		return
	}
	cert, _ := flag(c.Args, "tls-cert")
	key, _ := flag(c.Args, "tls-key")
	ca, hasCA := flag(c.Args, "tls-client-ca")
	if cert == "" || key == "" {
		t.Fatalf("tls.enabled without --tls-cert and --tls-key: %v", args)
	}
	if mutual := tlsValues["mutual"] == true; mutual != hasCA {
		t.Errorf("tls.mutual=%v but --tls-client-ca given: %v", mutual, hasCA)
	}
	// All three files come from one Secret volume (mounted as a directory: a renewal swaps it).
	var secret string
	for _, f := range []string{cert, key, ca} {
		if f == "" {
			continue
		}
		var found bool
		for _, m := range c.VolumeMounts {
			if filepath.Dir(f) == m.MountPath && m.SubPath == "" {
				v := volume(t, d.deployment.Spec.Template.Spec, m.Name)
				if v.Secret == nil {
					t.Errorf("%s is not on a Secret volume", f)
					continue
				}
				found, secret = true, v.Secret.SecretName
			}
		}
		if !found {
			t.Errorf("%s is not in a mounted Secret directory", f)
		}
	}
	for f, want := range map[string]string{cert: "tls.crt", key: "tls.key", ca: "ca.crt"} {
		if f != "" && filepath.Base(f) != want {
			t.Errorf("%s: want the kubernetes.io/tls key %s", f, want)
		}
	}
	if cm, _ := tlsValues["certManager"].(map[string]any); cm != nil {
		if d.certificate == nil {
			t.Fatal("tls.certManager.enabled renders no Certificate")
		}
		if d.certificate.Spec.SecretName != secret {
			t.Errorf("the Certificate writes Secret %s, the pod mounts %s", d.certificate.Spec.SecretName, secret)
		}
		fqdn := d.service.Name + "." + namespace + ".svc"
		if !slices.Contains(d.certificate.Spec.DNSNames, fqdn) {
			t.Errorf("the certificate's names %v do not include the Service's %s", d.certificate.Spec.DNSNames, fqdn)
		}
	}
}

func TestChartNotesWarnOfLimitsPerReplica(t *testing.T) {
	for name, values := range valueSets {
		t.Run(name, func(t *testing.T) {
			r := render(t, values)
			replicas := 2
			if n, ok := values["replicaCount"].(int); ok {
				replicas = n
			}
			_, cluster := values["cluster"]
			warned := strings.Contains(r.notes, "WARNING: "+itoa(int32(replicas))+" replicas without cluster mode")
			if want := replicas > 1 && !cluster; warned != want {
				t.Errorf("NOTES warn of per-replica limits: %v, want %v\n%s", warned, want, r.notes)
			}
			if warned && !strings.Contains(r.notes, "admits up to "+itoa(int32(replicas))+" times each limit") {
				t.Errorf("the warning does not say what the limits become:\n%s", r.notes)
			}
		})
	}
}

func TestChartRefusesBrokenValues(t *testing.T) {
	withCluster := string(readRepoFile(t, "examples/policy.yaml")) + "\ncluster:\n  backend: redis\n  addresses: [redis:6379]\n"
	cases := map[string]struct {
		values map[string]any
		want   string
	}{
		"tls without a certificate": {map[string]any{"tls": map[string]any{"enabled": true}}, "tls.enabled needs tls.secretName"},
		"mutual tls without tls":    {map[string]any{"tls": map[string]any{"mutual": true}}, "tls.mutual needs tls.enabled"},
		"cert-manager without an issuer": {map[string]any{"tls": map[string]any{"enabled": true, "certManager": map[string]any{"enabled": true}}},
			"needs tls.certManager.issuerRef"},
		"cluster without addresses": {map[string]any{"cluster": map[string]any{"enabled": true}}, "cluster.enabled needs cluster.addresses"},
		"two cluster sections": {map[string]any{"policy": map[string]any{"content": withCluster},
			"cluster": map[string]any{"enabled": true, "addresses": []any{"redis:6379"}}}, "already has a cluster section"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := tryRender(t, tc.values)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("render error %v, want one saying %q", err, tc.want)
			}
		})
	}
}

// A policy given in the values is used as written, and still gets the cluster section.
func TestChartPolicyFromValues(t *testing.T) {
	policy := "classification:\n  feature: {default: chat}\nfeatures:\n  chat: {max_concurrent: 3}\n"
	d := decodeAll(t, map[string]any{
		"policy":  map[string]any{"content": policy, "key": "bulkhead.yaml"},
		"cluster": map[string]any{"enabled": true, "addresses": []any{"redis:6379"}},
	})
	text := d.policy.Data["bulkhead.yaml"]
	if !strings.HasPrefix(text, policy) {
		t.Fatalf("the policy in the values is not kept as written:\n%s", text)
	}
	validatePolicy(t, text)
	if p := policyCluster(t, text); p.Cluster.Backend != "redis" {
		t.Errorf("rendered policy: cluster %+v", p.Cluster)
	}
	cfg, _ := flag(podContainer(t, d).Args, "config")
	if filepath.Base(cfg) != "bulkhead.yaml" {
		t.Errorf("--config=%s does not follow policy.key", cfg)
	}

	// An existing ConfigMap replaces the chart's.
	d = decodeAll(t, map[string]any{"policy": map[string]any{"existingConfigMap": "my-policy"}})
	if d.policy.Name != "" {
		t.Errorf("the chart still renders ConfigMap %s", d.policy.Name)
	}
	if v := volume(t, d.deployment.Spec.Template.Spec, "policy"); v.ConfigMap == nil || v.ConfigMap.Name != "my-policy" {
		t.Errorf("the pods do not mount my-policy: %+v", v)
	}
}

// The chart ships examples/policy.yaml, examples/alerts.yaml and examples/grafana-dashboard.json
// themselves (files/ links to them), so the chart cannot drift from the examples.
func TestChartFilesAreTheExamples(t *testing.T) {
	c := loadChart(t)
	files := map[string][]byte{}
	for _, f := range c.Files {
		files[f.Name] = f.Data
	}
	for inChart, example := range map[string]string{
		"files/policy.yaml":            "examples/policy.yaml",
		"files/alerts.yaml":            "examples/alerts.yaml",
		"files/grafana-dashboard.json": "examples/grafana-dashboard.json",
	} {
		if !bytes.Equal(files[inChart], readRepoFile(t, example)) {
			t.Errorf("the chart's %s is not %s", inChart, example)
		}
		if target, err := os.Readlink(filepath.Join(chartDir, inChart)); err != nil || target != filepath.Join("../../../..", example) {
			t.Errorf("%s/%s should be a link to %s (one source of truth), is %q (%v)", chartDir, inChart, example, target, err)
		}
	}
}

// helm lint: the chart's structure and every template, with the defaults and each value set.
func TestChartLint(t *testing.T) {
	for name, values := range valueSets {
		t.Run(name, func(t *testing.T) {
			linter := lint.RunAll(chartDir, values, namespace)
			for _, m := range linter.Messages {
				if m.Severity >= support.WarningSev {
					t.Errorf("helm lint: %s", m)
				}
			}
		})
	}
}

func TestChartAdminSecretIsRandom(t *testing.T) {
	a, b := decodeAll(t, nil), decodeAll(t, nil)
	ta, tb := a.secret.Data["token"], b.secret.Data["token"]
	if len(ta) < 32 || bytes.Equal(ta, tb) {
		t.Errorf("admin tokens %q and %q: want a long random token per install", ta, tb)
	}
}

// validatePolicy runs `llm-bulkhead validate` on a rendered policy: the server's own checks.
func validatePolicy(t *testing.T, text string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(llmBulkhead, "validate", "--config", path).CombinedOutput(); err != nil {
		t.Fatalf("llm-bulkhead validate refuses the rendered policy: %v\n%s\n%s", err, out, text)
	}
}

// renderedPolicy is the part of a rendered policy the chart writes: its cluster section.
type renderedPolicy struct {
	Cluster struct {
		Backend     string   `json:"backend"`
		Addresses   []string `json:"addresses"`
		Mode        string   `json:"mode"`
		PasswordEnv string   `json:"password_env"`
		TLS         struct {
			Enabled  bool   `json:"enabled"`
			CAFile   string `json:"ca_file"`
			CertFile string `json:"cert_file"`
			KeyFile  string `json:"key_file"`
		} `json:"tls"`
	} `json:"cluster"`
}

func policyCluster(t *testing.T, text string) renderedPolicy {
	t.Helper()
	var p renderedPolicy
	if err := yaml.Unmarshal([]byte(text), &p); err != nil {
		t.Fatal(err)
	}
	return p
}

func labelsSelector(m map[string]string) (labels.Selector, error) {
	if len(m) == 0 {
		return labels.Nothing(), nil
	}
	return labels.SelectorFromSet(m), nil
}

func keys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func itoa(n int32) string { return strconv.Itoa(int(n)) }

module github.com/passage-boot/passage/kube/kubevirthook

go 1.26.0

replace github.com/passage-boot/passage => ../..

// KubeVirt v1.9.0's own replace block but for two changes. Its ./staging paths (absent
// from the module zip) are its published kubevirt.io/api and client-go v1.9.0. Its k8s.io
// pins (v0.34.2, kube-openapi f3f2b991d03b) are kube/'s versions instead (v0.37.2,
// d427ff9ee9ad), and grpc is required at kube/'s v1.82.1; protobuf, genproto, k8s.io/utils,
// cbor, yaml/v2 and structured-merge-diff then select kube/'s versions too. The hook does
// not build KubeVirt, only the packages it imports (pkg/dra/metadata, pkg/hooks,
// pkg/hooks/info, pkg/hooks/v1alpha3, pkg/virt-launcher/virtwrap/api,
// pkg/virt-launcher/virtwrap/device/hostdevice/dra, kubevirt.io/api/core/v1) and their
// dependencies, and those compile and pass the hook's tests against kube/'s versions. So
// every module both kube/ and the hook compile is at one version, and make test's vet and
// race tests reuse kube/'s compiled Kubernetes, grpc and protobuf packages from the Go
// build cache rather than compile a second stack. kube/harness's TestHookSharesKube fails
// naming any module the two compile at different versions: a KubeVirt bump, or a kube/
// bump, changes this block too. The other k8s.io lines follow at v0.37.2
// (apiextensions-apiserver, which kube/ does not compile, stays one release with
// apimachinery; the hook compiles nothing of the rest). The openshift, OLM and nxadm/tail
// lines are KubeVirt's; the hook compiles nothing of those modules either.
replace (
	github.com/nxadm/tail => github.com/nxadm/tail v0.0.0-20211216163028-4472660a31a6
	github.com/openshift/api => github.com/openshift/api v0.0.0-20210105115604-44119421ec6b
	github.com/openshift/client-go => github.com/openshift/client-go v0.0.0-20210112165513-ebc401615f47
	github.com/operator-framework/operator-lifecycle-manager => github.com/operator-framework/operator-lifecycle-manager v0.0.0-20190128024246-5eb7ae5bdb7a

	k8s.io/api => k8s.io/api v0.37.2
	k8s.io/apiextensions-apiserver => k8s.io/apiextensions-apiserver v0.37.2
	k8s.io/apimachinery => k8s.io/apimachinery v0.37.2
	k8s.io/apiserver => k8s.io/apiserver v0.37.2
	k8s.io/client-go => k8s.io/client-go v0.37.2
	k8s.io/cloud-provider => k8s.io/cloud-provider v0.37.2
	k8s.io/cluster-bootstrap => k8s.io/cluster-bootstrap v0.37.2
	k8s.io/code-generator => k8s.io/code-generator v0.37.2
	k8s.io/component-base => k8s.io/component-base v0.37.2
	k8s.io/cri-api => k8s.io/cri-api v0.37.2
	k8s.io/csi-translation-lib => k8s.io/csi-translation-lib v0.37.2
	k8s.io/klog => k8s.io/klog v0.4.0
	k8s.io/kube-aggregator => k8s.io/kube-aggregator v0.37.2
	k8s.io/kube-controller-manager => k8s.io/kube-controller-manager v0.37.2
	k8s.io/kube-openapi => k8s.io/kube-openapi v0.0.0-20260721132016-d427ff9ee9ad
	k8s.io/kube-proxy => k8s.io/kube-proxy v0.37.2
	k8s.io/kube-scheduler => k8s.io/kube-scheduler v0.37.2
	k8s.io/kubectl => k8s.io/kubectl v0.37.2
	k8s.io/kubelet => k8s.io/kubelet v0.37.2
	k8s.io/legacy-cloud-providers => k8s.io/legacy-cloud-providers v0.37.2
	k8s.io/metrics => k8s.io/metrics v0.37.2
	k8s.io/node-api => k8s.io/node-api v0.37.2
	k8s.io/sample-apiserver => k8s.io/sample-apiserver v0.37.2
	k8s.io/sample-cli-plugin => k8s.io/sample-cli-plugin v0.37.2
	k8s.io/sample-controller => k8s.io/sample-controller v0.37.2
	kubevirt.io/api => kubevirt.io/api v1.9.0
	kubevirt.io/client-go => kubevirt.io/client-go v1.9.0
)

require (
	github.com/passage-boot/passage v0.0.0-00010101000000-000000000000
	golang.org/x/sys v0.50.0
	google.golang.org/grpc v1.82.1
	k8s.io/api v0.37.2
	k8s.io/apimachinery v0.37.2
	kubevirt.io/api v1.8.0
	kubevirt.io/kubevirt v1.9.0
	libvirt.org/go/libvirtxml v1.12008.0
	sigs.k8s.io/yaml v1.6.0
)

require (
	github.com/fxamacker/cbor/v2 v2.9.1 // indirect
	github.com/go-kit/log v0.2.1 // indirect
	github.com/go-logfmt/logfmt v0.6.0 // indirect
	github.com/go-logr/logr v1.4.3 // indirect
	github.com/golang/protobuf v1.5.4 // indirect
	github.com/google/uuid v1.6.0 // indirect
	github.com/json-iterator/go v1.1.12 // indirect
	github.com/modern-go/concurrent v0.0.0-20180306012644-bacd9c7ef1dd // indirect
	github.com/modern-go/reflect2 v1.0.3-0.20250322232337-35a7c28c31ee // indirect
	github.com/openshift/custom-resource-status v1.1.2 // indirect
	github.com/secure-systems-lab/go-securesystemslib v0.11.1 // indirect
	github.com/x448/float16 v0.8.4 // indirect
	go.uber.org/mock v0.5.1 // indirect
	go.yaml.in/yaml/v2 v2.4.4 // indirect
	golang.org/x/crypto v0.55.0 // indirect
	golang.org/x/net v0.57.0 // indirect
	golang.org/x/text v0.41.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260526163538-3dc84a4a5aaa // indirect
	google.golang.org/protobuf v1.36.12-0.20260120151049-f2248ac996af // indirect
	gopkg.in/inf.v0 v0.9.1 // indirect
	gopkg.in/yaml.v3 v3.0.1 // indirect
	k8s.io/apiextensions-apiserver v0.37.2 // indirect
	k8s.io/klog/v2 v2.140.0 // indirect
	k8s.io/kube-openapi v0.31.0 // indirect
	k8s.io/utils v0.0.0-20260626114624-be93311217bd // indirect
	kubevirt.io/client-go v0.0.0-00010101000000-000000000000 // indirect
	kubevirt.io/containerized-data-importer-api v1.64.0 // indirect
	kubevirt.io/controller-lifecycle-operator-sdk/api v0.2.4 // indirect
	sigs.k8s.io/json v0.0.0-20250730193827-2d320260d730 // indirect
	sigs.k8s.io/randfill v1.0.0 // indirect
	sigs.k8s.io/structured-merge-diff/v6 v6.4.2 // indirect
)

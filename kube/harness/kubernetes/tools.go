//go:build tools

// Package kube only names the control plane's commands, and the kubelet the node's
// QEMU guest runs, so go mod tidy pins everything they import; build.sh builds them.
package kube

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)

// Package deploy is passage's cluster side as an operator applies it: kustomization.yaml
// and the files it lists (daemonset.yaml, passage-control-crd.yaml,
// passage-control.yaml), and kubevirt-hook.yaml, the example a tenant's VMI follows. It
// has no code; its test renders the kustomization with the kustomize library kubectl
// v1.37 runs for kubectl apply -k, under an operator's overlay.
package deploy

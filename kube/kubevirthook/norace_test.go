//go:build !race

package kubevirthook

const raceFactor = 1

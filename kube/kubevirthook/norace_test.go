//go:build !race

package hook

const raceFactor = 1

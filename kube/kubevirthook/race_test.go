//go:build race

package kubevirthook

// raceFactor stretches answerBound under the race detector, which makes encoding/xml,
// most of a call's time, several times slower.
const raceFactor = 5

"""CSM (Sesame's Conversational Speech Model): a Llama backbone that predicts codebook 0 of each
Mimi frame, a depth decoder that predicts codebooks 1..31, and the Mimi codec decoder."""
